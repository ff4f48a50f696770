"""The calibrator's search space: the YAML specification (`space:` what may vary, `measure:` how a trial is timed,
`search:` how trials are chosen), the space resolved against a model and its registered drafters, and how a
trial's parameters become a SelfSpecConfig. Shipped specifications: search_spaces/ next to this file."""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ...config import SelfSpecConfig
from ...drafters.registry import DRAFTERS, searching

# each drafter's knobs are its registry entry's (drafters/registry.py: DrafterEntry.searched)
SEARCHABLE_DRAFTERS = tuple(name for name, entry in DRAFTERS.items() if entry.searchable)
EXIT_DRAFTERS = searching("exit_layer")  # drafters that run layers [0, E) + the exit head
# drafters whose tree shapes the study searches (ngram trees draft without a head: measured slower, left out)
TREE_DRAFTERS = searching("draft_tree_top_k")
NGRAM_DRAFTERS = searching("ngram_max")
RUN_DRAFTERS = searching("copy_draft_tokens")  # drafters whose chains may run past K while they copy
# the shipped search specifications, package data (installed with the wheel): <model>.yaml and default.yaml
SEARCH_SPACES = Path(__file__).resolve().parent / "search_spaces"


# --- the search specification (YAML) -------------------------------------------------------------------------
@dataclass
class SpaceSpec:
    """`space:` of the YAML, before the model is known. Ranges are {min, max[, step]}; see search_spaces/."""

    exit_layer: object = "auto"  # "auto" | [list] | {min, max, step}
    max_draft_tokens: object = field(default_factory=lambda: {"min": 1, "max": 8})
    draft_confidence_threshold: object = field(default_factory=lambda: {"min": 0.0, "max": 0.9, "step": 0.1})
    # early_exit and hybrid chains: judge a draft by its own top probability (false) or the chain's path (true)
    draft_confidence_cumulative: object = field(default_factory=lambda: [False, True])
    # chains of a copy head and of the hybrid: how far past K a chain may run while it copies (0: never; [0]
    # searches none)
    copy_draft_tokens: object = field(default_factory=lambda: [0])
    drafter: object = field(default_factory=lambda: ["early_exit", "ngram", "hybrid"])
    ngram_max: object = field(default_factory=lambda: {"min": 2, "max": 5})
    hybrid_min_match: object = field(default_factory=lambda: {"min": 1, "max": 4})
    # named policies (drafters/hybrid.py); trees draft lookup-when-copying as lookup-when-unsure
    hybrid_policy: object = field(default_factory=lambda: ["lookup-first", "lookup-then-head", "lookup-when-unsure"])
    # early_exit and hybrid: children per tree node (1 = chains; [1] alone searches no trees) and nodes per tree
    draft_tree_top_k: object = field(default_factory=lambda: [1])
    draft_tree_size: object = field(default_factory=lambda: {"min": 4, "max": 16, "step": 2})


@dataclass
class MeasureSpec:
    """`measure:` how one trial is timed."""

    max_prompts: int = 6  # calibration prompts taken from the prompt file (round-robin over categories)
    max_new_tokens: int = 40  # tokens generated per prompt
    warmup_new_tokens: int = 4  # untimed generation with the trial's setting before timing it
    timing_repeats: int = 5  # repeats of each cost-model micro-timing (the fastest taken: load only adds time)
    # how the user decodes: greedy by default; with sample, every timed generate samples at this temperature and
    # top-p from the same seed, since sampling accepts fewer drafts and the fastest setting differs
    sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    # which turns of each prompt are timed: 1, the first user turn; 2, the second, asked after the model's own
    # greedy answer to the first (answer_tokens long), as Spec-Bench runs MT-bench. [1, 2] times both, so each
    # question counts twice
    turns: list = field(default_factory=lambda: [1])
    answer_tokens: int = 128

    def __post_init__(self):
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"measure.temperature must be > 0 and measure.top_p in (0, 1], got temperature "
                             f"{self.temperature} and top_p {self.top_p}.")
        if not isinstance(self.turns, list) or not self.turns or not set(self.turns) <= {1, 2} \
                or len(set(self.turns)) < len(self.turns):
            raise ValueError(f"measure.turns must list 1, 2 or both (e.g. [1, 2]), got {self.turns!r}.")
        if self.answer_tokens < 1:
            raise ValueError(f"measure.answer_tokens must be >= 1, got {self.answer_tokens}.")

    @property
    def decoding(self) -> str:
        """'greedy', or the sampling settings in words: what a study's trials were timed with."""
        return f"sample, temperature {self.temperature}, top-p {self.top_p}" if self.sample else "greedy"


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
    # where even the re-timed best is slower than plain generate (a CPU where a 3-token pass costs two steps), the
    # config written drafts nothing (drafter "none": selfspec's loop decoding as plain generate does), so that
    # wrapping never makes generation slower than the calibration measured; per_drafter keeps each drafter's best
    plain_if_slower: bool = True
    # every other trial goes to the kind of drafting (chain, tree, each other drafter) with the fewest trials so
    # far, so that each kind's best (per_drafter: what bench runs per method) comes from more than a few trials;
    # TPE alone spends nearly all on the leading kind
    balance_kinds: bool = True
    # the best this many measured settings of each kind join the final re-timing too (0: only final_candidates),
    # so that per_drafter (what bench runs per method) is chosen side by side: within a kind the top settings lie
    # closer together than one trial's timing noise
    final_per_kind: int = 0
    # settings measured first, each written as a per_drafter entry is (a hand-set candidate, or one that won
    # elsewhere, weighed against the search's own); each must lie in the space
    enqueue: list = field(default_factory=list)


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
    """A YAML file, or the name of a shipped search space (`smollm2-135m`, `default`)."""
    import yaml

    if not os.path.isfile(path):
        shipped = SEARCH_SPACES / f"{path}.yaml"
        if os.sep in str(path) or "/" in str(path) or not shipped.is_file():
            raise FileNotFoundError(f"Search space file {str(path)!r} not found; pass a YAML file like "
                                    f"{SEARCH_SPACES / 'default.yaml'} or a shipped space's name "
                                    f"({', '.join(shipped_spaces())}).")
        path = shipped
    with open(path) as f:
        return SearchSpec.from_dict(yaml.safe_load(f) or {}, source=str(path))


def shipped_spaces() -> list[str]:
    return sorted(p.stem for p in SEARCH_SPACES.glob("*.yaml"))


def default_space_path(model_name: str | None) -> Path | None:
    """The shipped search space for the model (search_spaces/<model>.yaml), else search_spaces/default.yaml."""
    names = ([f"{Path(str(model_name)).name}.yaml"] if model_name else []) + ["default.yaml"]
    return next((SEARCH_SPACES / n for n in names if (SEARCH_SPACES / n).is_file()), None)


@dataclass
class SearchSpace:
    """The space resolved against a model: what trials may suggest."""

    exit_layers: list[int]
    max_draft_tokens: list[int]
    thresholds: tuple[float, float, float]  # min, max, step (step 0 = continuous)
    drafters: list[str]
    ngram_max: list[int]
    hybrid_min_match: list[int] = field(default_factory=lambda: [2])
    hybrid_policy: list[str] = field(default_factory=lambda: ["lookup-then-head"])
    cumulative: list[bool] = field(default_factory=lambda: [False])  # draft_confidence_cumulative of chains
    copy_draft_tokens: list[int] = field(default_factory=lambda: [0])  # of early_exit and hybrid chains
    tree_top_k: list[int] = field(default_factory=lambda: [1])
    tree_sizes: list[int] = field(default_factory=lambda: [8])

    @property
    def searches_trees(self) -> bool:
        return self.tree_top_k != [1]

    def tree_shapes(self) -> list[tuple[int, int]]:
        """(top_k, size) pairs of the space; (1, 0) stands for chains."""
        return [(1, 0)] * (1 in self.tree_top_k) + [(t, n) for t in self.tree_top_k if t > 1 for n in self.tree_sizes]

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
    return SearchSpace(
        exit_layers=_resolve_exits(s.exit_layer, num_layers, head_layers, src),
        max_draft_tokens=_int_range(s.max_draft_tokens, "max_draft_tokens", src),  # K >= 1 drafts per step
        thresholds=_threshold_range(s.draft_confidence_threshold, src),
        drafters=_resolve_drafters(s.drafter, registered, src),
        ngram_max=_int_range(s.ngram_max, "ngram_max", src),
        hybrid_min_match=_int_range(s.hybrid_min_match, "hybrid_min_match", src),
        hybrid_policy=_policies(s.hybrid_policy, src),
        cumulative=_bools(s.draft_confidence_cumulative, "draft_confidence_cumulative", src),
        copy_draft_tokens=_int_range(s.copy_draft_tokens, "copy_draft_tokens", src, minimum=0),
        tree_top_k=_int_range(s.draft_tree_top_k, "draft_tree_top_k", src),
        tree_sizes=_int_range(s.draft_tree_size, "draft_tree_size", src, minimum=2))


def _bools(value, name: str, source: str) -> list[bool]:
    """A yes/no knob of the space: true, false or a list of them, True first (as the study enqueues it)."""
    values = [value] if isinstance(value, bool) else list(value or [])
    if not values or not all(isinstance(v, bool) for v in values):
        raise ValueError(f"{source}: space.{name} must be true, false or a list of them, got {value!r}.")
    return sorted(set(values), reverse=True)


def _policies(value, source: str) -> list[str]:
    """The hybrid policies to search: a name or a list of names (drafters/hybrid.py POLICIES)."""
    from ...drafters.hybrid import POLICIES

    values = [value] if isinstance(value, str) else list(value or [])
    bad = [v for v in values if v not in POLICIES]
    if not values or bad:
        raise ValueError(f"{source}: space.hybrid_policy must be one or more of {list(POLICIES)}, got {value!r}.")
    return list(dict.fromkeys(values))


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


def suggest(trial, space: SearchSpace) -> dict:
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
    if params["drafter"] in TREE_DRAFTERS and space.searches_trees:
        params["draft_tree_top_k"] = _suggest_from(trial, "draft_tree_top_k", space.tree_top_k)
        if params["draft_tree_top_k"] > 1:
            params["draft_tree_size"] = _suggest_from(trial, "draft_tree_size", space.tree_sizes)
    if params["drafter"] in EXIT_DRAFTERS and params.get("draft_tree_top_k", 1) == 1:  # a tree's is on the path
        params["draft_confidence_cumulative"] = trial.suggest_categorical("draft_confidence_cumulative",
                                                                          space.cumulative)
    chain = params["drafter"] in RUN_DRAFTERS and params.get("draft_tree_top_k", 1) == 1
    if chain and space.copy_draft_tokens != [0]:
        params["copy_draft_tokens"] = trial.suggest_categorical("copy_draft_tokens", space.copy_draft_tokens)
    if params["drafter"] in NGRAM_DRAFTERS:
        params["ngram_max"] = _suggest_from(trial, "ngram_max", space.ngram_max)
    if params["drafter"] in searching("hybrid_policy"):
        params["hybrid_min_match"] = _suggest_from(trial, "hybrid_min_match", space.hybrid_min_match)
        params["hybrid_policy"] = trial.suggest_categorical("hybrid_policy", space.hybrid_policy)
    return params


def _suggest_from(trial, name: str, values: list[int]) -> int:
    steps = {b - a for a, b in zip(values, values[1:])}
    if len(values) == 1 or len(steps) == 1:  # an evenly spaced range keeps its order for TPE
        return trial.suggest_int(name, values[0], values[-1], step=steps.pop() if steps else 1)
    return trial.suggest_categorical(name, values)


def effective_params(params: dict) -> dict:
    """A trial's params as the engine runs them: Optuna's stepped floats without their binary noise
    (0.35000000000000003), a tree's size raised to its depth K (a tree as deep as K needs K nodes), and a chain
    said to be one (draft_tree_top_k=1; the base config may grow trees). What per_drafter records, so that the
    bench runs the very setting that was measured."""
    out = {k: round(v, 10) if isinstance(v, float) else v for k, v in params.items()}
    # trees are searched for early_exit only: every other trial is a chain, whatever the base config grows
    out.setdefault("draft_tree_top_k", 1)
    if out.get("drafter") in RUN_DRAFTERS and out["draft_tree_top_k"] == 1:  # runs past K only where searched
        out.setdefault("copy_draft_tokens", 0)
    if out.get("draft_tree_top_k", 1) > 1 and out.get("draft_tree_size", 0) < out.get("max_draft_tokens", 0):
        out["draft_tree_size"] = out["max_draft_tokens"]
    return out


def trial_config(base: SelfSpecConfig, params: dict) -> SelfSpecConfig:
    """The base config with a trial's setting, in every decoding mode (a sampled study times it as sampled)."""
    config = base.replace(**effective_params(params), sampling={})
    if config.ngram_min > config.ngram_max:
        config = config.replace(ngram_min=config.ngram_max)
    return config


def kinds(space: SearchSpace) -> list[str]:
    """The kinds of drafting the space holds, as tree_key names them: each drafter, and the trees of those that
    grow them apart from their chains when the space has both."""
    out = []
    for drafter in space.drafters:
        if drafter in TREE_DRAFTERS and space.searches_trees:
            out += [drafter] * (1 in space.tree_top_k) + [f"{drafter}-tree"]
        elif drafter != "none":
            out.append(drafter)
    return out


def kind_params(kind: str, space: SearchSpace, turn: int) -> dict:
    """The params that fix a trial to one kind (the sampler chooses the rest); trees cycle through the space's
    widths with `turn`."""
    drafter = kind.removesuffix("-tree")
    if drafter != kind:
        widths = [t for t in space.tree_top_k if t > 1]
        return {"drafter": drafter, "draft_tree_top_k": widths[turn % len(widths)]}
    if kind in TREE_DRAFTERS and space.searches_trees:
        return {"drafter": kind, "draft_tree_top_k": 1}
    return {"drafter": kind}


def in_space(params: dict, space: SearchSpace) -> bool:
    """Whether a recorded setting (a per_drafter entry) is one the space can suggest: its drafter, and every knob
    the space searches for that drafter, within the space's values."""
    if params.get("drafter") not in space.drafters:
        return False
    allowed = {"max_draft_tokens": space.max_draft_tokens, "ngram_max": space.ngram_max,
               "hybrid_min_match": space.hybrid_min_match, "hybrid_policy": space.hybrid_policy,
               "draft_confidence_cumulative": space.cumulative, "copy_draft_tokens": space.copy_draft_tokens,
               "draft_tree_top_k": space.tree_top_k,
               "draft_tree_size": space.tree_sizes}
    if params["drafter"] in EXIT_DRAFTERS:
        allowed["exit_layer"] = space.exit_layers
        lo, hi, _ = space.thresholds
        if not lo - 1e-9 <= params.get("draft_confidence_threshold", lo) <= hi + 1e-9:
            return False
    return all(params[k] in values for k, values in allowed.items() if k in params)


def tree_key(params: dict) -> str:
    """The name a setting's best is recorded under in per_drafter: the drafter, "-tree" for draft trees."""
    return params.get("drafter", "early_exit") + ("-tree" if params.get("draft_tree_top_k", 1) > 1 else "")


def describe(params: dict) -> str:
    parts = [params["drafter"]]
    for key, short in (("exit_layer", "E"), ("max_draft_tokens", "K"), ("draft_confidence_threshold", "thr"),
                       ("draft_confidence_cumulative", "path"), ("copy_draft_tokens", "copy"),
                       ("draft_tree_top_k", "top_k"), ("draft_tree_size", "size"), ("ngram_max", "n"),
                       ("hybrid_min_match", "match"), ("hybrid_policy", "policy")):
        if key in params and not (key == "copy_draft_tokens" and not params[key]):  # no runs past K: unsaid
            value = params[key]
            parts.append(f"{short}={value:.2f}" if isinstance(value, float) else f"{short}={value}")
    return " ".join(parts)
