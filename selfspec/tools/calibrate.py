"""`selfspec calibrate`: find the fastest self-speculative setting for a model, its heads, a prompt set and this
device, with an Optuna study whose trials are real timed generations.

    selfspec calibrate --model smollm2-135m [--heads DIR] [--prompts FILE] [--trials N] [--timeout S]
                       [--storage URL] [--output DIR] [--space configs/search/smollm2-135m.yaml]
    python -m selfspec.calibrate ...   # the same

Searched: exit layer, max_draft_tokens, draft_confidence_threshold, the drafter (early_exit, and ngram / hybrid
when registered) and ngram_max. The objective is generated tokens/s of greedy `generate` over the calibration
prompts, with warm-up and device synchronisation. A cost model (cost_model.py) measured once per exit layer
predicts every early-exit setting first: the predicted best are enqueued as the first trials and settings
predicted far below the best measured so far are pruned unmeasured. The best setting is re-timed against plain
`generate` in the same run and written to --output with a Markdown + JSON report.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import SelfSpecConfig
from ..prompts import EVAL_CATEGORIES, chat_input_ids, load_prompts
from ..wrap import wrap
from . import cost_model
from .measure import environment as measure_environment
from .measure import eos_ids_of, model_identity, spearman, timed

SEARCHABLE_DRAFTERS = ("early_exit", "ngram", "hybrid", "none")
EXIT_DRAFTERS = ("early_exit", "hybrid")  # drafters that run layers [0, E) + the exit head
NGRAM_DRAFTERS = ("ngram", "hybrid")
REPO_ROOT = Path(__file__).resolve().parents[2]
REPORT_NAME = "calibration_report"


# --- the search specification (YAML) -------------------------------------------------------------------------
@dataclass
class SpaceSpec:
    """`space:` of the YAML, before the model is known. Ranges are {min, max[, step]}; see configs/search/."""

    exit_layer: object = "auto"  # "auto" | [list] | {min, max, step}
    max_draft_tokens: object = field(default_factory=lambda: {"min": 1, "max": 8})
    draft_confidence_threshold: object = field(default_factory=lambda: {"min": 0.0, "max": 0.9, "step": 0.1})
    drafter: object = field(default_factory=lambda: ["early_exit", "ngram", "hybrid"])
    ngram_max: object = field(default_factory=lambda: {"min": 2, "max": 5})
    hybrid_min_match: object = field(default_factory=lambda: {"min": 1, "max": 4})
    hybrid_extend: object = field(default_factory=lambda: [True, False])


@dataclass
class MeasureSpec:
    """`measure:` how one trial is timed."""

    max_prompts: int = 6  # calibration prompts taken from the prompt file (round-robin over categories)
    max_new_tokens: int = 40  # greedy tokens generated per prompt
    warmup_new_tokens: int = 4  # untimed generation with the trial's setting before timing it
    timing_repeats: int = 5  # repeats of each cost-model micro-timing (median taken)


@dataclass
class StrategySpec:
    """`search:` how trials are chosen."""

    seed: int = 0
    startup_trials: int = 5  # TPE's random trials (enqueued ones count)
    enqueue_top: int = 5  # cost model's best (exit layer, K) pairs measured first
    prune_below: float = 0.6  # prune a trial whose prediction is below this share of the best measured
    min_measured: int = 3  # no pruning before this many measured trials
    final_candidates: int = 3  # best measured settings re-timed against plain generate at the end
    final_rounds: int = 2  # interleaved rounds of that re-timing


@dataclass
class SearchSpec:
    space: SpaceSpec = field(default_factory=SpaceSpec)
    measure: MeasureSpec = field(default_factory=MeasureSpec)
    search: StrategySpec = field(default_factory=StrategySpec)
    source: str = "<defaults>"

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> "SearchSpec":
        data = dict(data or {})
        _reject_unknown(data, {"space", "measure", "search"}, source, "top level")
        parts = {}
        for key, part_cls in (("space", SpaceSpec), ("measure", MeasureSpec), ("search", StrategySpec)):
            section = dict(data.get(key) or {})
            _reject_unknown(section, {f.name for f in dataclasses.fields(part_cls)}, source, key)
            parts[key] = part_cls(**section)
        return cls(**parts, source=source)

    def to_dict(self) -> dict:
        return {"space": dataclasses.asdict(self.space), "measure": dataclasses.asdict(self.measure),
                "search": dataclasses.asdict(self.search), "source": self.source}


def _reject_unknown(section: dict, known: set, source: str, where: str) -> None:
    unknown = set(section) - known
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {sorted(unknown)} in {where}; known: {sorted(known)}.")


def load_search_spec(path: str | os.PathLike) -> SearchSpec:
    import yaml

    if not os.path.isfile(path):
        raise FileNotFoundError(f"Search space file {str(path)!r} not found; see configs/search/default.yaml.")
    with open(path) as f:
        return SearchSpec.from_dict(yaml.safe_load(f) or {}, source=str(path))


def default_space_path(model_name: str | None) -> Path | None:
    """configs/search/<model>.yaml when the checkout has one, else configs/search/default.yaml, else None."""
    folder = REPO_ROOT / "configs" / "search"
    names = ([f"{Path(str(model_name)).name}.yaml"] if model_name else []) + ["default.yaml"]
    return next((folder / n for n in names if (folder / n).is_file()), None)


@dataclass
class SearchSpace:
    """The space resolved against a model: what trials may suggest."""

    exit_layers: list[int]
    max_draft_tokens: list[int]
    thresholds: tuple[float, float, float]  # min, max, step (step 0 = continuous)
    drafters: list[str]
    ngram_max: list[int]
    hybrid_min_match: list[int] = field(default_factory=lambda: [2])
    hybrid_extend: list[bool] = field(default_factory=lambda: [True])

    def threshold_grid(self) -> list[float]:
        lo, hi, step = self.thresholds
        if step <= 0:
            return sorted({lo, hi})
        return [round(lo + i * step, 10) for i in range(int(math.floor((hi - lo) / step + 1e-9)) + 1)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _int_range(value, name: str, source: str, minimum: int = 1) -> list[int]:
    """[list] | {min, max, step} | int -> sorted list of ints, each >= minimum."""
    values = _int_values(value, name, source)
    if values[0] < minimum:
        raise ValueError(f"{source}: space.{name} must be >= {minimum}, got {values[0]}.")
    return values


def _int_values(value, name: str, source: str) -> list[int]:
    if isinstance(value, bool):
        raise ValueError(f"{source}: space.{name} must be a list of integers or {{min, max, step}}, got {value!r}.")
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        if not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError(f"{source}: space.{name} must be a non-empty list of integers, got {value!r}.")
        return sorted(set(value))
    if isinstance(value, dict) and {"min", "max"} <= set(value) <= {"min", "max", "step"}:
        lo, hi, step = value["min"], value["max"], value.get("step", 1)
        if not all(isinstance(v, int) for v in (lo, hi, step)) or step < 1 or lo > hi:
            raise ValueError(f"{source}: space.{name} needs integers min <= max and step >= 1, got {value!r}.")
        return list(range(lo, hi + 1, step))
    raise ValueError(f"{source}: space.{name} must be a list of integers or {{min, max, step}}, got {value!r}.")


def _threshold_range(value, source: str) -> tuple[float, float, float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        lo = hi = float(value)
        step = 0.0
    elif isinstance(value, dict) and {"min", "max"} <= set(value) <= {"min", "max", "step"}:
        lo, hi, step = float(value["min"]), float(value["max"]), float(value.get("step", 0.0))
    else:
        raise ValueError(f"{source}: space.draft_confidence_threshold must be a number or {{min, max, step}}, "
                         f"got {value!r}.")
    if not 0.0 <= lo <= hi < 1.0 or step < 0:
        raise ValueError(f"{source}: space.draft_confidence_threshold needs 0 <= min <= max < 1 and step >= 0, "
                         f"got min={lo}, max={hi}, step={step}.")
    return lo, hi, step


def resolve_space(spec: SearchSpec, num_layers: int, head_layers: list[int], registered) -> SearchSpace:
    """Check the space against the model and the registered drafters; raise ValueError naming the fix."""
    s, src = spec.space, spec.source
    extend = [s.hybrid_extend] if isinstance(s.hybrid_extend, bool) else list(s.hybrid_extend or [])
    if not extend or not all(isinstance(v, bool) for v in extend):
        raise ValueError(f"{src}: space.hybrid_extend must be true, false or a list of them, got {s.hybrid_extend!r}.")
    return SearchSpace(
        exit_layers=_resolve_exits(s.exit_layer, num_layers, head_layers, src),
        max_draft_tokens=_int_range(s.max_draft_tokens, "max_draft_tokens", src),  # K >= 1 drafts per step
        thresholds=_threshold_range(s.draft_confidence_threshold, src),
        drafters=_resolve_drafters(s.drafter, registered, src),
        ngram_max=_int_range(s.ngram_max, "ngram_max", src),
        hybrid_min_match=_int_range(s.hybrid_min_match, "hybrid_min_match", src),
        hybrid_extend=sorted(set(extend), reverse=True))


def _resolve_exits(value, num_layers: int, head_layers: list[int], source: str) -> list[int]:
    if value == "auto":
        return sorted(head_layers) if head_layers else list(range(1, num_layers))
    exits = _int_values(value, "exit_layer", source)
    bad = [e for e in exits if not 1 <= e <= num_layers - 1]
    if bad:
        raise ValueError(f"{source}: space.exit_layer includes {bad}, but the model has {num_layers} decoder layers: "
                         f"exit layers must lie in 1..{num_layers - 1} (layers [0, E) draft, the rest verify). "
                         f"Fix space.exit_layer (or use 'auto').")
    return exits


def _resolve_drafters(value, registered, source: str) -> list[str]:
    names = [value] if isinstance(value, str) else list(value or [])
    unknown = [n for n in names if n not in SEARCHABLE_DRAFTERS]
    if unknown or not names:
        raise ValueError(f"{source}: space.drafter must list drafters among {SEARCHABLE_DRAFTERS}, got {value!r}.")
    available = [n for n in names if n in registered]
    skipped = [n for n in names if n not in registered]
    if skipped:
        print(f"calibrate: drafter(s) {skipped} not registered in this install; searching {available}.",
              file=sys.stderr)
    if not available:
        raise ValueError(f"{source}: none of the drafters {names} is registered (registered: {sorted(registered)}).")
    return available


# --- calibration prompts -------------------------------------------------------------------------------------
def load_calibration_texts(path: str | None, count: int) -> list[str]:
    """First user turns to calibrate on: Spec-Bench's train split (its MT-bench categories) by default, or the
    user's JSONL (Spec-Bench format) / text file. Evaluation categories are dropped from any file: never
    calibrate on what the benchmarks report."""
    if path is None:
        prompts = load_prompts(split="train")
    else:
        prompts = load_prompts(path, split="all")
        kept = [p for p in prompts if p.category not in EVAL_CATEGORIES]
        if len(kept) < len(prompts):
            print(f"calibrate: dropped {len(prompts) - len(kept)} prompts of Spec-Bench's evaluation categories "
                  f"{EVAL_CATEGORIES}.", file=sys.stderr)
        if not kept:
            raise ValueError(f"{path} holds no calibration prompts outside the evaluation categories.")
        prompts = kept
    return pick_prompts([(p.category, p.text) for p in prompts], count)


def pick_prompts(prompts: list[tuple[str, str]], count: int) -> list[str]:
    """Round-robin over categories in file order, so a few prompts still cover every category."""
    by_category: dict[str, list[str]] = {}
    for category, text in prompts:
        by_category.setdefault(category, []).append(text)
    picked, depth = [], 0
    while len(picked) < count and any(depth < len(v) for v in by_category.values()):
        picked += [v[depth] for v in by_category.values() if depth < len(v)]
        depth += 1
    return picked[:count]


def encode_prompts(tokenizer, texts: list[str], device) -> list[torch.Tensor]:
    """(1, T) ids per prompt: the chat template with a generation prompt when the tokenizer has one."""
    return [chat_input_ids(tokenizer, text).to(device) for text in texts]


# --- timed generation ----------------------------------------------------------------------------------------
@dataclass
class Measurement:
    tokens_per_s: float
    new_tokens: int
    seconds: float
    outputs: list[torch.Tensor]  # generated ids (N,) per prompt
    stats: dict = field(default_factory=dict)  # summed GenerationStats fields (speculative runs only)


def _generate(model, ids: torch.Tensor, new_tokens: int, plain: bool) -> torch.Tensor:
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=_pad_id(model))
    # the class's generate is Hugging Face's own; the instance attribute is the wrapped one
    generate = type(model).generate.__get__(model) if plain else model.generate
    return generate(ids, **kwargs)[0, ids.shape[1]:]


def _pad_id(model) -> int:
    """The generation config's pad id, else its first EOS id (as Hugging Face's generate pads), else 0."""
    pad = model.generation_config.pad_token_id
    return int(pad) if pad is not None else next(iter(eos_ids_of(model)), 0)


_STAT_KEYS = ("new_tokens", "verify_steps", "drafted_tokens", "accepted_tokens", "draft_seconds", "verify_seconds",
              "prefill_seconds")


@torch.no_grad()
def time_generation(model, prompts: list[torch.Tensor], new_tokens: int, plain: bool) -> Measurement:
    """Greedy generation of every prompt, timed with device synchronisation; stats summed over prompts."""
    device = prompts[0].device
    outputs, seconds, totals = [], 0.0, dict.fromkeys(_STAT_KEYS, 0)
    for ids in prompts:
        out, took = timed(lambda: _generate(model, ids, new_tokens, plain), device)
        seconds += took
        outputs.append(out.cpu())
        if not plain:
            stats = model.selfspec.last_stats
            for key in _STAT_KEYS:
                totals[key] += getattr(stats, key)
    total = sum(o.numel() for o in outputs)
    if not plain:
        totals["acceptance_rate"] = totals["accepted_tokens"] / max(totals["drafted_tokens"], 1)
        totals["mean_accepted_tokens"] = totals["new_tokens"] / max(totals["verify_steps"], 1)
    return Measurement(total / seconds if seconds else 0.0, total, seconds, outputs, {} if plain else totals)


def time_setting(model, config: SelfSpecConfig, prompts, measure: MeasureSpec) -> Measurement:
    """Switch the engine to `config`, warm it up untimed, then time it."""
    model.selfspec.config = config.validate(model.selfspec.adapter.num_layers)
    if measure.warmup_new_tokens:
        _generate(model, prompts[0], measure.warmup_new_tokens, plain=False)
    return time_generation(model, prompts, measure.max_new_tokens, plain=False)


# --- the cost model's view of the space ----------------------------------------------------------------------
MODELLED_DRAFTERS = ("early_exit", "ngram")  # hybrid mixes both per row and step: measured only


def _param_key(params: dict) -> tuple:
    return tuple(sorted((k, round(v, 10) if isinstance(v, float) else v) for k, v in params.items()))


@dataclass
class Predictor:
    """Predicted tokens/s of early-exit and prompt-lookup settings, from the replayed loop and the timings."""

    timings: cost_model.Timings
    sequences: list[cost_model.Sequence]
    eos: list[list[bool]]  # [sequence][answer token] is an EOS id
    acceptance: dict[int, cost_model.LayerAcceptance]
    ngram: dict = field(default_factory=dict)  # ngram_min, eos_ids, k_max, lookup_seconds (None: not modelled)
    max_new_tokens: int | None = None  # what the answers were generated with (the loop's draft budget reads it)
    grid: dict[tuple, tuple[dict, cost_model.Prediction]] = field(default_factory=dict)
    _proposals: dict[int, list] = field(default_factory=dict)

    def predict(self, params: dict) -> cost_model.Prediction | None:
        key = _param_key(params)
        if key not in self.grid:
            prediction = self._compute(params)
            if prediction is None:
                return None
            self.grid[key] = (dict(params), prediction)
        return self.grid[key][1]

    def _compute(self, params: dict) -> cost_model.Prediction | None:
        drafter = params.get("drafter")
        if drafter == "early_exit" and params["exit_layer"] in self.acceptance:
            return cost_model.predict(self.acceptance[params["exit_layer"]], self.eos, self.timings,
                                      params["max_draft_tokens"], params["draft_confidence_threshold"],
                                      self.max_new_tokens)
        if drafter == "ngram" and self.ngram.get("lookup_seconds") is not None:
            counts = cost_model.simulate_ngram(self.sequences, self._ngram_proposals(params["ngram_max"]), self.eos,
                                               params["max_draft_tokens"], self.max_new_tokens)
            return cost_model.predict_ngram(counts, self.timings, self.ngram["lookup_seconds"])
        return None

    def _ngram_proposals(self, n_max: int) -> list:
        if n_max not in self._proposals:
            n_min = min(self.ngram["ngram_min"], n_max)
            self._proposals[n_max] = [cost_model.ngram_proposals(s, self.ngram["k_max"], n_max, n_min,
                                                                 self.ngram["eos_ids"]) for s in self.sequences]
        return self._proposals[n_max]

    def fill(self, space: SearchSpace) -> None:
        ks = space.max_draft_tokens
        if "early_exit" in space.drafters:
            for e in space.exit_layers:
                for k in ks:
                    for thr in space.threshold_grid():
                        self.predict(_early_params(e, k, thr))
        if "ngram" in space.drafters:
            for k in ks:
                for n in space.ngram_max:
                    self.predict({"drafter": "ngram", "max_draft_tokens": k, "ngram_max": n})

    def best(self, top: int) -> list[tuple[dict, cost_model.Prediction]]:
        """The `top` best predictions, one per (drafter, exit layer, K), plus the best of each drafter."""
        ranked = sorted(self.grid.values(), key=lambda item: item[1].tokens_per_s, reverse=True)
        picked, groups = [], set()
        for params, prediction in ranked:
            group = (params["drafter"], params.get("exit_layer"), params["max_draft_tokens"])
            if group not in groups and len(picked) < top:
                groups.add(group)
                picked.append((params, prediction))
        for drafter in {p["drafter"] for p, _ in ranked} - {p["drafter"] for p, _ in picked}:
            picked.append(next(item for item in ranked if item[0]["drafter"] == drafter))
        return picked

    def plain_tokens_per_s(self) -> float:
        """The engine with no drafts (drafter "none"), for a sanity check of the timings against plain generate."""
        new = sum(s.answer.numel() for s in self.sequences)
        return new / cost_model.plain_seconds(self.timings, new, len(self.sequences))

    def profile_summary(self, max_k: int) -> dict:
        return {str(e): {"agreement": round(a.agreement, 4),
                         "position_profile": [round(p, 4) for p in a.position_profile(max_k)]}
                for e, a in self.acceptance.items()}


def _early_params(exit_layer: int, k: int, threshold: float) -> dict:
    return {"drafter": "early_exit", "exit_layer": exit_layer, "max_draft_tokens": k,
            "draft_confidence_threshold": threshold}


def _engine_seconds(model, config: SelfSpecConfig, prompt, new_tokens: int, repeats: int = 2) -> dict:
    """Draft seconds per drafted token and per step, verify seconds per step, of the fastest of short runs."""
    model.selfspec.config = config
    best = None
    for _ in range(repeats):
        _generate(model, prompt, new_tokens, plain=False)
        s = model.selfspec.last_stats
        if best is None or s.draft_seconds + s.verify_seconds < best.draft_seconds + best.verify_seconds:
            best = s
    steps = max(best.verify_steps - 1, 1)  # verify_steps counts the prefill too
    return {"draft_token": best.draft_seconds / max(best.drafted_tokens, 1), "draft_step": best.draft_seconds / steps,
            "verify_step": best.verify_seconds / steps}


def _loop_overheads(model, base: SelfSpecConfig, prompt, space: SearchSpace, new_tokens: int) -> dict:
    """Per-step costs the micro-timings miss, from short engine runs: verify seconds per step without drafts,
    draft seconds per early-exit token, prompt-lookup seconds per step."""
    out = {"none_step": _engine_seconds(model, base.replace(drafter="none"), prompt, new_tokens)["verify_step"]}
    if "early_exit" in space.drafters:
        early = base.replace(drafter="early_exit", exit_layer=space.exit_layers[0], max_draft_tokens=2,
                             draft_confidence_threshold=0.0)
        out["draft_token"] = _engine_seconds(model, early, prompt, new_tokens)["draft_token"]
    if "ngram" in space.drafters:
        ngram = trial_config(base, {"drafter": "ngram", "max_draft_tokens": space.max_draft_tokens[-1],
                                    "ngram_max": space.ngram_max[-1]})
        out["lookup_step"] = _engine_seconds(model, ngram, prompt, new_tokens)["draft_step"]
    model.selfspec.config = base
    return out


@torch.no_grad()
def build_predictor(model, base: SelfSpecConfig, prompts, answers, space: SearchSpace, measure: MeasureSpec,
                    log) -> Predictor | None:
    if not set(space.drafters) & set(MODELLED_DRAFTERS):
        return None
    engine = model.selfspec
    t0 = time.perf_counter()
    sequences = [cost_model.Sequence(p, a.to(p.device)) for p, a in zip(prompts, answers) if a.numel()]
    exits = space.exit_layers if "early_exit" in space.drafters else []
    acceptance = cost_model.measure_acceptance(engine, sequences, exits) if exits else {}
    timings = cost_model.measure_timings(engine, prompts, exits, space.max_draft_tokens[-1] + 1,
                                         measure.timing_repeats)
    loop = _loop_overheads(model, base, prompts[0], space, min(16, measure.max_new_tokens))
    timings = cost_model.fit_overheads(timings, loop["none_step"], loop.get("draft_token"),
                                       exits[0] if exits else None)
    eos_ids = eos_ids_of(model)
    eos = [[int(t) in set(eos_ids) for t in s.answer.tolist()] for s in sequences]
    ngram = {"ngram_min": base.ngram_min, "eos_ids": eos_ids, "k_max": space.max_draft_tokens[-1],
             "lookup_seconds": loop.get("lookup_step")}
    predictor = Predictor(timings, sequences, eos, acceptance, ngram, measure.max_new_tokens)
    predictor.fill(space)
    log(f"cost model: {len(exits)} exit layers profiled, {len(predictor.grid)} settings predicted "
        f"in {time.perf_counter() - t0:.1f}s")
    return predictor


# --- the study -----------------------------------------------------------------------------------------------
def study_identity(model, name: str | None) -> dict:
    """What a study's trials were measured on: the model (measure.model_identity) and the heads it drafts with."""
    return {**model_identity(model, name), "heads": sorted(model.selfspec.heads)}


def environment(model) -> dict:
    return measure_environment(next(model.parameters()).device, ("optuna",))


def open_study(storage: str, study_name: str, identity: dict, seed: int, startup: int):
    """Create the study or resume it; a stored study made for another model or device is refused. A study stored
    before the identity recorded a key (the LM-head fingerprint came later) is compared on the keys it has."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True, group=True)
    study = optuna.create_study(study_name=study_name, storage=storage, direction="maximize", sampler=sampler,
                                load_if_exists=True)
    stored = study.user_attrs.get("identity")
    diff = {k: (stored[k], identity[k]) for k in identity if k in (stored or {}) and stored[k] != identity[k]}
    if diff:
        raise ValueError(f"Study {study_name!r} in {storage} was made for another setup (stored vs now: {diff}); "
                         "pass another --study-name or --storage.")
    if stored is None:
        study.set_user_attr("identity", identity)
    return study


def _suggest(trial, space: SearchSpace) -> dict:
    """Define-by-run: exit layer and threshold only for drafters that use the exit head, ngram_max only for
    drafters that match n-grams."""
    params = {"drafter": trial.suggest_categorical("drafter", space.drafters)}
    if params["drafter"] != "none":
        params["max_draft_tokens"] = _suggest_from(trial, "max_draft_tokens", space.max_draft_tokens)
    if params["drafter"] in EXIT_DRAFTERS:
        params["exit_layer"] = _suggest_from(trial, "exit_layer", space.exit_layers)
        lo, hi, step = space.thresholds
        params["draft_confidence_threshold"] = trial.suggest_float(
            "draft_confidence_threshold", lo, hi, step=step or None)
    if params["drafter"] in NGRAM_DRAFTERS:
        params["ngram_max"] = _suggest_from(trial, "ngram_max", space.ngram_max)
    if params["drafter"] == "hybrid":
        params["hybrid_min_match"] = _suggest_from(trial, "hybrid_min_match", space.hybrid_min_match)
        params["hybrid_extend"] = trial.suggest_categorical("hybrid_extend", space.hybrid_extend)
    return params


def _suggest_from(trial, name: str, values: list[int]) -> int:
    steps = {b - a for a, b in zip(values, values[1:])}
    if len(values) == 1 or len(steps) == 1:  # an evenly spaced range keeps its order for TPE
        return trial.suggest_int(name, values[0], values[-1], step=steps.pop() if steps else 1)
    return trial.suggest_categorical(name, values)


def trial_config(base: SelfSpecConfig, params: dict) -> SelfSpecConfig:
    config = base.replace(**params)
    if config.ngram_min > config.ngram_max:
        config = config.replace(ngram_min=config.ngram_max)
    return config


def describe(params: dict) -> str:
    parts = [params["drafter"]]
    for key, short in (("exit_layer", "E"), ("max_draft_tokens", "K"), ("draft_confidence_threshold", "thr"),
                       ("ngram_max", "n"), ("hybrid_min_match", "match"), ("hybrid_extend", "extend")):
        if key in params:
            value = params[key]
            parts.append(f"{short}={value:.2f}" if isinstance(value, float) else f"{short}={value}")
    return " ".join(parts)


def _measured(study) -> list:
    import optuna

    return [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if t.user_attrs.get("measured")]


@dataclass
class Session:
    """Everything a trial needs; `objective` is the Optuna objective."""

    model: object
    base: SelfSpecConfig
    prompts: list[torch.Tensor]
    plain: Measurement
    space: SearchSpace
    spec: SearchSpec
    predictor: Predictor | None
    log: object = print
    measured_this_run: int = 0

    def objective(self, trial) -> float:
        import optuna

        params = _suggest(trial, self.space)
        prediction = self.predictor.predict(params) if self.predictor else None
        if prediction is not None:
            trial.set_user_attr("predicted_tokens_per_s", prediction.tokens_per_s)
            trial.set_user_attr("predicted_mean_accepted_tokens", prediction.mean_accepted_tokens)
            trial.set_user_attr("predicted_acceptance_rate", prediction.acceptance_rate)
        done = _measured(trial.study)
        twin = next((t for t in done if t.params == trial.params), None)
        if twin is not None:  # TPE re-proposed a measured setting: reuse it instead of paying again
            trial.set_user_attr("duplicate_of", twin.number)
            self.log(f"trial {trial.number:3d} {describe(params):40s} = trial {twin.number} ({twin.value:.2f} tok/s)")
            return twin.value
        reason = self.prune_reason(prediction, done)
        if reason:
            trial.set_user_attr("pruned_by_cost_model", reason)
            self.log(f"trial {trial.number:3d} {describe(params):40s} pruned: {reason}")
            raise optuna.TrialPruned(reason)
        m = time_setting(self.model, trial_config(self.base, params), self.prompts, self.spec.measure)
        self.record(trial, m)
        self.measured_this_run += 1
        self.log(self.progress_line(trial, params, m, prediction, done))
        return m.tokens_per_s

    def prune_reason(self, prediction, done) -> str | None:
        """Hopeless when the prediction, rescaled by how far predictions ran off so far, is far below the best."""
        strategy = self.spec.search
        if prediction is None or len(done) < strategy.min_measured:
            return None
        ratios = [t.value / t.user_attrs["predicted_tokens_per_s"] for t in done
                  if t.user_attrs.get("predicted_tokens_per_s")]
        scale = statistics.median(ratios) if ratios else 1.0
        best = max(t.value for t in done)
        expected = prediction.tokens_per_s * scale
        if expected < strategy.prune_below * best:
            return f"predicted {expected:.2f} tok/s < {strategy.prune_below:.2f} x best {best:.2f}"
        return None

    def record(self, trial, m: Measurement) -> None:
        trial.set_user_attr("measured", True)
        for key in ("acceptance_rate", "mean_accepted_tokens", "draft_seconds", "verify_seconds", "prefill_seconds",
                    "new_tokens", "verify_steps", "drafted_tokens", "accepted_tokens"):
            trial.set_user_attr(key, m.stats.get(key))
        trial.set_user_attr("seconds", m.seconds)
        trial.set_user_attr("speedup_vs_plain", m.tokens_per_s / self.plain.tokens_per_s)
        same = all(torch.equal(a, b) for a, b in zip(m.outputs, self.plain.outputs))
        trial.set_user_attr("matches_plain", same)  # greedy output must equal plain generate's

    def progress_line(self, trial, params, m: Measurement, prediction, done) -> str:
        best = max([t.value for t in done] + [m.tokens_per_s])
        pred = f"pred {prediction.tokens_per_s:6.2f}" if prediction else "pred    -  "
        flag = "" if trial.user_attrs.get("matches_plain") else "  OUTPUT DIFFERS FROM PLAIN"
        return (f"trial {trial.number:3d} {describe(params):40s} {m.tokens_per_s:6.2f} tok/s ({pred}) "
                f"accept {m.stats['acceptance_rate']:.2f} tok/step {m.stats['mean_accepted_tokens']:.2f} "
                f"| best {best:.2f}, plain {self.plain.tokens_per_s:.2f}{flag}")


def enqueue_predicted(study, predictor: Predictor | None, space: SearchSpace, top: int, log) -> None:
    """The cost model's best settings first, plus one default trial of each drafter it cannot model."""
    queued = []
    if predictor is not None:
        queued += [params for params, _ in predictor.best(top)]
    k_mid = _nearest(space.max_draft_tokens, 4)
    for drafter in space.drafters:
        if drafter == "none" or (predictor is not None and drafter in MODELLED_DRAFTERS):
            continue
        params = {"drafter": drafter, "max_draft_tokens": k_mid}
        if drafter in EXIT_DRAFTERS:
            early = next((p for p in queued if p["drafter"] == "early_exit"), None)
            params.update({k: early[k] for k in ("exit_layer", "draft_confidence_threshold")} if early else
                          {"exit_layer": space.exit_layers[len(space.exit_layers) // 2],
                           "draft_confidence_threshold": space.thresholds[0]})
        params["ngram_max"] = _nearest(space.ngram_max, 3)
        if drafter == "hybrid":
            params["hybrid_min_match"] = _nearest(space.hybrid_min_match, 2)
            params["hybrid_extend"] = space.hybrid_extend[0]
        queued.append(params)
    seen = [t.params for t in study.get_trials(deepcopy=False)]
    fresh = [p for p in queued if p not in seen]
    for params in fresh:
        study.enqueue_trial(params, user_attrs={"enqueued_by": "cost_model"})
    if fresh:
        log(f"enqueued {len(fresh)} trials: " + "; ".join(describe(p) for p in fresh))


def _nearest(values: list[int], target: int) -> int:
    return min(values, key=lambda v: (abs(v - target), v))


class _Budget:
    """Stop after `trials` measured trials of this run (pruned and duplicate trials are free), with a cap on
    all trials in case everything left is pruned."""

    def __init__(self, session: Session, trials: int | None):
        self.session, self.trials = session, trials
        self.started = 0

    def __call__(self, study, trial) -> None:
        self.started += 1
        if self.trials is None:
            return
        if self.session.measured_this_run >= self.trials or self.started >= 10 * self.trials + 20:
            study.stop()


# --- final comparison and report -----------------------------------------------------------------------------
def top_settings(study, count: int) -> list:
    done = sorted(_measured(study), key=lambda t: t.value, reverse=True)
    picked, seen = [], []
    for t in done:
        if t.params not in seen:
            seen.append(t.params)
            picked.append(t)
    return picked[:count]


def best_per_drafter(study) -> dict[str, dict]:
    """{drafter: params of its fastest measured trial}, so that each drafter can be run at its own best setting
    (an n-gram drafter wants other K than an exit head; the bench reads this)."""
    best: dict[str, tuple[float, dict]] = {}
    for t in _measured(study):
        drafter = t.params.get("drafter", "early_exit")
        if drafter not in best or t.value > best[drafter][0]:
            best[drafter] = (t.value, dict(t.params))
    return {d: params for d, (_, params) in sorted(best.items())}


def confirm(session: Session, candidates: list, rounds: int, log) -> tuple[list[dict], float]:
    """Re-time the best settings and plain generate prompt by prompt, in rotating order, so that load drifting
    over the run (other processes on a shared machine) hits every setting alike."""
    configs = [None] + [trial_config(session.base, t.params) for t in candidates]  # None: plain generate
    for config in configs[1:]:
        session.model.selfspec.config = config
        _generate(session.model, session.prompts[0], session.spec.measure.warmup_new_tokens or 2, plain=False)
    totals = [[0, 0.0] for _ in configs]
    turn = 0
    for _ in range(rounds):
        for ids in session.prompts:
            for j in [(turn + i) % len(configs) for i in range(len(configs))]:
                if configs[j] is not None:
                    session.model.selfspec.config = configs[j]
                m = time_generation(session.model, [ids], session.spec.measure.max_new_tokens, configs[j] is None)
                totals[j][0] += m.new_tokens
                totals[j][1] += m.seconds
            turn += 1
    plain_tps = totals[0][0] / totals[0][1]
    rows = [{"trial": t.number, "params": dict(t.params), "search_tokens_per_s": t.value,
             "confirmed_tokens_per_s": n / s, "speedup": n / s / plain_tps,
             "acceptance_rate": t.user_attrs.get("acceptance_rate"),
             "mean_accepted_tokens": t.user_attrs.get("mean_accepted_tokens")}
            for t, (n, s) in zip(candidates, totals[1:])]
    rows.sort(key=lambda r: r["confirmed_tokens_per_s"], reverse=True)
    for r in rows:
        log(f"confirm  {describe(r['params']):40s} {r['confirmed_tokens_per_s']:6.2f} tok/s "
            f"(x{r['speedup']:.2f} vs plain {plain_tps:.2f})")
    return rows, plain_tps


def trial_rows(study) -> list[dict]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        rows.append({"trial": t.number, "state": t.state.name, "params": dict(t.params), "value": t.value,
                     "predicted_tokens_per_s": attrs.get("predicted_tokens_per_s"),
                     "acceptance_rate": attrs.get("acceptance_rate"),
                     "mean_accepted_tokens": attrs.get("mean_accepted_tokens"),
                     "draft_seconds": attrs.get("draft_seconds"), "verify_seconds": attrs.get("verify_seconds"),
                     "matches_plain": attrs.get("matches_plain"), "measured": bool(attrs.get("measured")),
                     "pruned_by_cost_model": attrs.get("pruned_by_cost_model"),
                     "enqueued_by": attrs.get("enqueued_by")})
    return rows


@dataclass
class CalibrationResult:
    best: SelfSpecConfig
    best_tokens_per_s: float  # re-timed in the final comparison
    plain_tokens_per_s: float  # plain generate, timed in the same comparison
    study_name: str
    storage: str
    report: dict
    output: str | None = None

    @property
    def speedup(self) -> float:
        return self.best_tokens_per_s / self.plain_tokens_per_s


def build_report(study, session: Session, confirmed: list[dict], plain_tps: float, best: SelfSpecConfig) -> dict:
    rows = trial_rows(study)
    measured = [r for r in rows if r["measured"] and r["state"] == "COMPLETE"]
    paired = [r for r in measured if r["predicted_tokens_per_s"]]
    top5 = sorted(measured, key=lambda r: r["value"], reverse=True)[:5]
    predictor = session.predictor
    return {
        "best": best.to_dict(), "best_tokens_per_s": confirmed[0]["confirmed_tokens_per_s"],
        "plain_tokens_per_s": plain_tps, "speedup": confirmed[0]["confirmed_tokens_per_s"] / plain_tps,
        "confirmed": confirmed, "top5": top5, "trials": rows,
        "counts": {"trials": len(rows), "measured": len(measured),
                   "pruned_by_cost_model": sum(1 for r in rows if r["pruned_by_cost_model"]),
                   "duplicates": sum(1 for r in rows if r["state"] == "COMPLETE" and not r["measured"])},
        "cost_model": None if predictor is None else {
            "spearman_predicted_vs_measured": spearman([r["predicted_tokens_per_s"] for r in paired],
                                                       [r["value"] for r in paired]),
            "predicted_best": [{"params": p, "tokens_per_s": pr.tokens_per_s,
                                "mean_accepted_tokens": pr.mean_accepted_tokens}
                               for p, pr in predictor.best(5)],
            "predicted_plain_engine_tokens_per_s": predictor.plain_tokens_per_s(),
            "acceptance_profile": predictor.profile_summary(session.space.max_draft_tokens[-1]),
            "timings": predictor.timings.to_dict()},
        "study": {"name": study.study_name, "user_attrs": study.user_attrs},
        "measure": dataclasses.asdict(session.spec.measure), "space": session.space.to_dict(),
        "all_outputs_match_plain": all(r["matches_plain"] for r in measured),
    }


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report_markdown(report: dict) -> str:
    ident = report["study"]["user_attrs"].get("identity", {})
    env = report["study"]["user_attrs"].get("environment", {})
    lines = [
        f"# Calibration: {ident.get('model_name', '?')} on {ident.get('device', '?')} ({ident.get('dtype', '?')})",
        "",
        f"Best setting: `{describe(report['confirmed'][0]['params'])}` - "
        f"**{report['best_tokens_per_s']:.2f} tok/s** against plain `generate` at "
        f"{report['plain_tokens_per_s']:.2f} tok/s (**x{report['speedup']:.2f}**), both re-timed in the same run.",
        "",
        f"Study `{report['study']['name']}`: {report['counts']['trials']} trials, {report['counts']['measured']} "
        f"measured, {report['counts']['pruned_by_cost_model']} pruned by the cost model, "
        f"{report['counts']['duplicates']} duplicates. Greedy outputs of every measured trial equal plain generate: "
        f"{report['all_outputs_match_plain']}.",
        f"Measured on {report['measure']['max_new_tokens']} new tokens x prompts per trial; torch "
        f"{env.get('torch', '?')}, transformers {env.get('transformers', '?')}, {env.get('torch_threads', '?')} "
        f"threads, {_where(env)}.",
        "", "## Top 5 measured trials", "",
        "| trial | setting | measured tok/s | predicted tok/s | acceptance | tokens/step | draft s | verify s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["top5"]:
        lines.append(f"| {r['trial']} | `{describe(r['params'])}` | {_fmt(r['value'])} | "
                     f"{_fmt(r['predicted_tokens_per_s'])} | {_fmt(r['acceptance_rate'])} | "
                     f"{_fmt(r['mean_accepted_tokens'])} | {_fmt(r['draft_seconds'])} | {_fmt(r['verify_seconds'])} |")
    lines += ["", "## Final comparison (interleaved re-timing)", "", "| setting | tok/s | vs plain |",
              "| --- | --- | --- |"]
    lines += [f"| `{describe(r['params'])}` | {r['confirmed_tokens_per_s']:.2f} | x{r['speedup']:.2f} |"
              for r in report["confirmed"]]
    lines.append(f"| plain `generate` | {report['plain_tokens_per_s']:.2f} | x1.00 |")
    lines += _cost_model_markdown(report)
    return "\n".join(lines) + "\n"


def _where(env: dict) -> str:
    """The device a study ran on, from its environment (measure.environment; older studies: gpu / cpu_count)."""
    gpu = env.get("gpu") or (env.get("device") if env.get("device") not in (None, "cpu") else None)
    return gpu or f"{env.get('cpu') or env.get('machine', '?')} ({env.get('cores', env.get('cpu_count', '?'))} cores)"


def _cost_model_markdown(report: dict) -> list[str]:
    cm = report["cost_model"]
    if cm is None:
        return []
    lines = ["", "## Cost model", "",
             f"Spearman rank correlation of predicted vs measured tokens/s over measured trials: "
             f"{_fmt(cm['spearman_predicted_vs_measured'])}.", "",
             "| trial | setting | predicted tok/s | measured tok/s |", "| --- | --- | --- | --- |"]
    for r in report["trials"]:
        if r["measured"] and r["predicted_tokens_per_s"] is not None:
            lines.append(f"| {r['trial']} | `{describe(r['params'])}` | {r['predicted_tokens_per_s']:.2f} | "
                         f"{_fmt(r['value'])} |")
    lines += ["", "Teacher-forced agreement of the exit head with the full model (draft position 0, 1, 2 given the "
              "previous accepted):", "", "| exit layer | agreement | P(accept j \\| previous) j=0,1,2 |",
              "| --- | --- | --- |"]
    for layer, prof in cm["acceptance_profile"].items():
        lines.append(f"| {layer} | {prof['agreement']:.3f} | "
                     f"{', '.join(f'{p:.2f}' for p in prof['position_profile'][:3])} |")
    return lines


def save_result(model, best: SelfSpecConfig, report: dict, output: str, extra: dict) -> None:
    """Config (and heads, through the engine's save_pretrained when it exists) + the report, into `output`."""
    os.makedirs(output, exist_ok=True)
    engine = model.selfspec
    engine.config = best
    if hasattr(engine, "save_pretrained"):
        with torch.no_grad():  # the base model's fingerprint reads its weights
            engine.save_pretrained(output)
    else:
        best.save(output, extra=extra)
    with open(os.path.join(output, REPORT_NAME + ".json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(os.path.join(output, REPORT_NAME + ".md"), "w") as f:
        f.write(report_markdown(report))


# --- the whole run -------------------------------------------------------------------------------------------
def default_storage(output: str) -> str:
    return f"sqlite:///{os.path.abspath(os.path.join(output, 'study.db'))}"


def _ensure_wrapped(model) -> None:
    """Wrap with the default config, its exit layer clipped to small models (trials set their own)."""
    if getattr(model, "selfspec", None) is None:
        from ..arch import adapter_for

        layers = adapter_for(model).num_layers
        wrap(model, exit_layer=min(SelfSpecConfig().exit_layer, max(layers - 1, 1)))


def calibrate(model, prompts: list[torch.Tensor], spec: SearchSpec | None = None, *, storage: str | None = None,
              output: str | None = None, study_name: str | None = None, trials: int | None = None,
              timeout: float | None = None, model_name: str | None = None, log=print) -> CalibrationResult:
    """Search the fastest setting of `model` (wrapped or not; heads already attached) over `prompts` ((1, T) ids
    each). The space is checked before anything runs. Writes config + report into `output` when given."""
    import optuna
    from ..drafters import DRAFTER_FACTORIES

    spec = spec or SearchSpec()
    _ensure_wrapped(model)
    model.selfspec.timed = True  # the cost model reads draft and verify seconds: make them true on a GPU too
    engine = model.selfspec
    base = engine.config
    space = resolve_space(spec, engine.adapter.num_layers, list(engine.heads), DRAFTER_FACTORIES)
    _check_budget(trials, timeout, prompts)
    if storage is None:
        if output is None:
            raise ValueError("calibrate needs a storage URL or an output directory for the study.")
        os.makedirs(output, exist_ok=True)
        storage = default_storage(output)
    trials = 20 if trials is None and timeout is None else trials
    identity = study_identity(model, model_name)
    study_name = study_name or _default_study_name(identity)
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    log(f"calibrate: {identity['model_name']} ({identity['num_layers']} layers) on {identity['device']} "
        f"{identity['dtype']}, {len(prompts)} prompts x {spec.measure.max_new_tokens} tokens, "
        f"exit layers {space.exit_layers}, drafters {space.drafters}")
    study = open_study(storage, study_name, identity, spec.search.seed, spec.search.startup_trials)
    session = _prepare_session(model, base, prompts, space, spec, log)
    _set_study_attrs(study, session, spec, space)
    enqueue_predicted(study, session.predictor, space, spec.search.enqueue_top, log)
    study.optimize(session.objective, timeout=timeout, callbacks=[_Budget(session, trials)],
                   catch=(torch.cuda.OutOfMemoryError,) if torch.cuda.is_available() else ())
    return _finish(model, study, session, base, storage, output, identity, log)


def _check_budget(trials, timeout, prompts) -> None:
    if trials is not None and trials < 1:
        raise ValueError(f"--trials must be >= 1, got {trials}.")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {timeout}.")
    if not prompts:
        raise ValueError("calibrate needs at least one prompt.")


def _default_study_name(identity: dict) -> str:
    name = Path(str(identity["model_name"])).name or "model"
    heads = "heads" + "-".join(map(str, identity["heads"])) if identity["heads"] else "untrained"
    return f"{name}-{heads}-{identity['device']}-{identity['dtype'].replace('torch.', '')}"


def _prepare_session(model, base, prompts, space, spec, log) -> Session:
    measure = spec.measure
    _generate(model, prompts[0], max(measure.warmup_new_tokens, 2), plain=True)  # warm-up: first calls are slow
    plain = time_generation(model, prompts, measure.max_new_tokens, plain=True)
    log(f"plain generate: {plain.tokens_per_s:.2f} tok/s ({plain.new_tokens} tokens in {plain.seconds:.1f}s)")
    predictor = build_predictor(model, base, prompts, plain.outputs, space, measure, log)
    return Session(model, base, prompts, plain, space, spec, predictor, log)


def _set_study_attrs(study, session: Session, spec: SearchSpec, space: SearchSpace) -> None:
    study.set_user_attr("environment", environment(session.model))
    study.set_user_attr("search_spec", spec.to_dict())
    study.set_user_attr("space", space.to_dict())
    study.set_user_attr("plain_tokens_per_s_at_start", session.plain.tokens_per_s)
    if session.predictor is not None:
        study.set_user_attr("acceptance_profile", session.predictor.profile_summary(space.max_draft_tokens[-1]))


def _finish(model, study, session, base, storage, output, identity, log) -> CalibrationResult:
    candidates = top_settings(study, session.spec.search.final_candidates)
    if not candidates:
        raise RuntimeError(f"No trial of study {study.study_name!r} was measured; raise --trials or --timeout.")
    confirmed, plain_tps = confirm(session, candidates, session.spec.search.final_rounds, log)
    winner = confirmed[0]
    best = trial_config(base, winner["params"]).replace(metadata={
        "calibration": {"tokens_per_s": winner["confirmed_tokens_per_s"], "plain_tokens_per_s": plain_tps,
                        "speedup": winner["speedup"], "study": study.study_name, "trial": winner["trial"],
                        "device": identity["device"], "dtype": identity["dtype"],
                        "date": time.strftime("%Y-%m-%d"), "environment": environment(model),
                        "per_drafter": best_per_drafter(study)}})
    study.set_user_attr("final", {"best": winner, "plain_tokens_per_s": plain_tps})
    report = build_report(study, session, confirmed, plain_tps, best)
    if output is not None:
        from .. import __version__

        save_result(model, best, report, output, {"selfspec_version": __version__})
        log(f"wrote {output}/selfspec_config.json and {REPORT_NAME}.md/.json")
    model.selfspec.config = best
    log(f"best: {describe(winner['params'])} {winner['confirmed_tokens_per_s']:.2f} tok/s vs plain "
        f"{plain_tps:.2f} (x{winner['speedup']:.2f})")
    return CalibrationResult(best, winner["confirmed_tokens_per_s"], plain_tps, study.study_name, storage, report,
                             output)


# --- command line --------------------------------------------------------------------------------------------
def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="selfspec calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="known name, local HF directory or hub id")
    p.add_argument("--heads", help="directory with trained exit heads (and a selfspec config) to calibrate")
    p.add_argument("--prompts", help="Spec-Bench JSONL (first turn, chat template) or text file, one prompt a line;"
                                     " default: Spec-Bench's MT-bench categories (the train split)")
    p.add_argument("--trials", type=int, help="measured trials in this run (default 20 without --timeout)")
    p.add_argument("--timeout", type=float, help="search budget in seconds (setup and final re-timing extra)")
    p.add_argument("--storage", help="Optuna storage URL (default sqlite:///OUTPUT/study.db)")
    p.add_argument("--study-name", help="default: model-heads-device-dtype")
    p.add_argument("--output", help="where config, report and study go (default: --heads, else calibration/MODEL)")
    p.add_argument("--space", help="search space YAML (default configs/search/MODEL.yaml or default.yaml)")
    p.add_argument("--max-prompts", type=int, help="override measure.max_prompts")
    p.add_argument("--max-new-tokens", type=int, help="override measure.max_new_tokens")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="model precision; auto = the checkpoint's dtype, or for the embedded model bfloat16 where "
                        "the device computes it in hardware, else float32 (default: auto)")
    p.add_argument("--threads", type=int, help="torch intra-op threads on CPU")
    return p.parse_args(argv)


def _load_spec(args) -> SearchSpec:
    path = args.space or default_space_path(args.model)
    spec = load_search_spec(path) if path else SearchSpec()
    if args.max_prompts is not None:
        spec.measure.max_prompts = args.max_prompts
    if args.max_new_tokens is not None:
        spec.measure.max_new_tokens = args.max_new_tokens
    if spec.measure.max_prompts < 1 or spec.measure.max_new_tokens < 2:
        raise ValueError("measure.max_prompts must be >= 1 and measure.max_new_tokens >= 2.")
    return spec


def _load_model(args):
    from ..models import resolve_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # the plain baseline is this same model object unwrapped, so it always runs in the wrapped model's dtype
    model, tokenizer = resolve_model(args.model, dtype=args.dtype, device=device)
    if args.heads:
        wrap(model, args.heads)  # config and heads saved by save_pretrained
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = _load_spec(args)
    model, tokenizer = _load_model(args)
    texts = load_calibration_texts(args.prompts, spec.measure.max_prompts)
    prompts = encode_prompts(tokenizer, texts, next(model.parameters()).device)
    output = args.output or args.heads or os.path.join("calibration", Path(str(args.model)).name)
    result = calibrate(model, prompts, spec, storage=args.storage, output=output, study_name=args.study_name,
                       trials=args.trials, timeout=args.timeout, model_name=str(args.model))
    print(f"best {describe(result.report['confirmed'][0]['params'])}: {result.best_tokens_per_s:.2f} tok/s, plain "
          f"{result.plain_tokens_per_s:.2f} tok/s, x{result.speedup:.2f}; config and report in {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
