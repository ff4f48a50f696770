"""`selfspec bench`: Spec-Bench-style benchmark of self-speculative decoding against Hugging Face's own methods.

One model load; every method runs on the same prompts and weights, interleaved prompt by prompt (the baseline
first, the others in an order that rotates per prompt) after a warm-up, with the device synchronised around each
timed `generate`. Each method's output is checked token for token against the plain model's (`hf-greedy`). Where
it parts from it, the first differing position gets a verdict (verdict.py): *near-tie* where the plain model's
own gap between the two tokens is within its 1-token vs multi-token rounding discrepancy there (half precision
rounds those passes differently), else *differs*, a bug. Each is printed to stderr as it happens, counted per
method (identical / near-tie / differs) and kept in the JSON; --strict fails on *differs* only.

    selfspec bench --limit 4                        # 4 prompts per eval category, SmolLM2-135M, greedy
    python -m selfspec.bench --methods hf-greedy selfspec oracle --categories qa --max-new-tokens 64

Writes `results.md` (a table per category and overall), `results.json` (machine, versions, model, settings,
per-prompt records) and `speedup.png` into `--output`. `--report DIR` and `--update PAGE` turn saved results into
the tables the docs show (report.py), without loading a model.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from ..chat import user_turn
from ..compiled import compiled_so_far
from ..config import SelfSpecConfig
from ..prompts import EVAL_CATEGORIES, TRAIN_CATEGORIES, Prompt, left_pad, load_prompts
from ..signals import sigterm_as_interrupt
from .measure import eos_ids_of, loadavg, machine_info, sampling_kwargs, step_speedups, timed, versions
from .bench_methods import (BASELINE, CORE_METHODS, DEFAULT_TREE, METHODS, EngineMethod, Method, Outcome,
                            engine_settings, select_methods)
from .bench_report import exactness_line, render_markdown, summarize, write_outputs
from .report import add_arguments as add_report_arguments
from .report import main_report
from .verdict import DIFFERS, PlainLogits, first_difference, judge

DEFAULT_OUTPUT_ROOT = "bench_results"


# --- settings -------------------------------------------------------------------------------------------------
@dataclass
class BenchConfig:
    model: str = "smollm2-135m"
    prompts: str | None = None  # Spec-Bench-format JSONL; None = the Spec-Bench questions shipped in the package
    categories: tuple | None = None  # None = the eval split of the shipped file, every category of --prompts
    limit: int | None = None  # prompts per category
    max_new_tokens: int = 128
    batch_size: int = 1
    methods: tuple = ()  # empty = default_methods()
    exit_layer: int | None = None  # overrides the selfspec config's, for every engine method
    max_draft_tokens: int | None = None
    heads: str | None = None  # directory with selfspec_config.json (+ heads) for the `selfspec` method
    hf_exit_layers: tuple = ()  # candidates for hf-early-exit; empty = L/4, L/2, 3L/4 and the selfspec exit
    prompt_lookup_tokens: int = 10  # Hugging Face's documented example value
    sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus sampling (Hugging Face's top_p), with sample; 1.0 keeps the whole distribution
    seed: int = 0
    warmup_tokens: int = 16
    tune_tokens: int = 32
    dtype: str = "auto"  # auto: the checkpoint's own; the embedded model: bf16 where the CPU/GPU computes it
    device: str = "cpu"
    threads: int | None = None
    compile: bool = False  # every selfspec method runs compiled (as its -compiled variant)
    chat_template: bool = True
    output: str | None = None
    strict: bool = False
    time_budget: float | None = None  # seconds for the command: a batch that would end past them is not started


# --- prompts --------------------------------------------------------------------------------------------------
@dataclass
class Batch:
    category: str
    question_ids: list
    input_ids: torch.Tensor  # (B, T) left-padded
    attention_mask: torch.Tensor  # (B, T)

    @property
    def prompt_tokens(self) -> list[int]:
        return self.attention_mask.sum(-1).tolist()


@dataclass
class Workload:
    batches: list[Batch]  # measured, in category order
    warmup: Batch  # run once through every method, not recorded
    tune: list[Batch]  # where hf-early-exit's exit layer is chosen (train split: never the measured prompts)


def encode(tokenizer, prompt: Prompt, chat_template: bool) -> list[int]:
    """A prompt as one user turn (selfspec.chat): in the chat template where the tokenizer has one, as plain
    dialogue without one or with --no-chat-template."""
    return user_turn(tokenizer, prompt.text, None if chat_template else False)


def make_batches(tokenizer, prompts: list[Prompt], batch_size: int, chat_template: bool = True) -> list[Batch]:
    """Consecutive prompts of one category per batch (a category's last batch may be smaller)."""
    batches = []
    for category in dict.fromkeys(p.category for p in prompts):
        group = [p for p in prompts if p.category == category]
        for i in range(0, len(group), batch_size):
            chunk = group[i: i + batch_size]
            ids, mask = left_pad([encode(tokenizer, p, chat_template) for p in chunk], tokenizer.pad_token_id)
            batches.append(Batch(category, [p.question_id for p in chunk], ids, mask))
    return batches


def check_categories(cfg: BenchConfig) -> None:
    """The shipped Spec-Bench file's MT-bench categories train and calibrate heads: never report on them."""
    if cfg.prompts is None and cfg.categories:
        leaked = sorted(set(cfg.categories) & set(TRAIN_CATEGORIES))
        if leaked:
            raise ValueError(f"Categories {leaked} are the training/calibration split of Spec-Bench; benchmark on "
                             f"the eval split {list(EVAL_CATEGORIES)} (or pass --prompts FILE of your own).")


def build_workload(tokenizer, cfg: BenchConfig) -> Workload:
    check_categories(cfg)
    categories = list(cfg.categories) if cfg.categories else None
    prompts = load_prompts(cfg.prompts, split="eval", categories=categories, limit_per_category=cfg.limit)
    if not prompts:
        raise ValueError(f"No prompts selected from {cfg.prompts or 'Spec-Bench'} (categories {categories}).")
    batches = make_batches(tokenizer, prompts, cfg.batch_size, cfg.chat_template)
    # Warm-up and tuning prompts come from the training split, so no choice is ever made on measured prompts.
    train = load_prompts(None, split="train", limit_per_category=1)
    side = make_batches(tokenizer, train[:3], 1, cfg.chat_template)
    return Workload(batches, warmup=side[0], tune=side[1:])


# --- the harness ----------------------------------------------------------------------------------------------
def trim_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """Generated tokens up to and including the first EOS (what follows is padding)."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens


class Harness:
    """The loaded model and everything every method shares: generate settings, selfspec config, heads."""

    def __init__(self, model, cfg: BenchConfig, pad_id: int, eos_ids: list[int]):
        self.model, self.cfg, self.pad_id, self.eos_ids = model, cfg, pad_id, set(eos_ids)
        self.device = next(model.parameters()).device
        self.num_layers = _num_layers(model)
        self.base_config, self.heads, self.heads_source = load_selfspec_setup(model, cfg)
        self.hf_exit_layer = self.base_config.exit_layer
        self.plain_logits = PlainLogits(model, {"pad_token_id": pad_id})
        # each drafter's best from the calibration of this run's decoding mode (a sampled one where it exists)
        self.per_drafter = self.base_config.calibration(cfg.sample).get("per_drafter", {})
        self.oracle_k: int | None = None  # set by bound_oracle once the run's methods are known

    def row_judge(self, batch: Batch, max_new: int, chunk: int) -> Callable:
        """judge_row(b, got, want) -> Verdict for row b of this batch, for a method whose verify passes run up to
        `chunk` tokens."""
        def judge_row(b, got, want):
            prompt = batch.input_ids[b][batch.attention_mask[b].bool()].tolist()
            # a batch's reference is plain generate over the padded batch: its own logits there are judged
            row = (batch.input_ids, batch.attention_mask, b) if len(batch.question_ids) > 1 else None
            return judge(self.model, self.plain_logits, prompt, got, want, max_new, chunk=chunk, batch_row=row)
        return judge_row

    def engine_config(self, drafter: str, trained: bool, tree: bool = False) -> SelfSpecConfig:
        """The config of an engine method: each drafter at the best setting the calibrator measured for it
        (`metadata.calibration.per_drafter`), unless the command line fixed E or K. Settings found with trained
        heads are not given to the untrained head; the n-gram drafter has no heads and takes its own. A tree
        method takes the drafter's calibrated tree (key "<drafter>-tree"), else its chain's with DEFAULT_TREE; every
        other method drafts chains."""
        config = self.base_config.for_mode(self.cfg.sample) if trained else SelfSpecConfig(
            exit_layer=self.base_config.exit_layer, max_draft_tokens=self.base_config.max_draft_tokens)
        tuned = dict(self.per_drafter.get(drafter, {})) if (trained or drafter == "ngram") else {}
        if tree:
            tuned = dict(self.per_drafter.get(f"{drafter}-tree") or {**tuned, **DEFAULT_TREE})
        else:  # a chain method drafts chains even where the config it starts from (the calibrated winner) grows trees
            tuned["draft_tree_top_k"] = 1
        if drafter == "oracle" and self.oracle_k is not None:
            tuned["max_draft_tokens"] = self.oracle_k
        for fixed, key in ((self.cfg.exit_layer, "exit_layer"), (self.cfg.max_draft_tokens, "max_draft_tokens")):
            if fixed is not None:
                tuned.pop(key, None)
        return config.replace(**{**tuned, "drafter": drafter})

    def bound_oracle(self, registry: dict, names: list[str]) -> None:
        """The oracle drafts at the longest K of any other engine method in the run, so that it bounds them all
        (a method drafting up to 7 tokens could otherwise beat an oracle held to 4)."""
        ks = [registry[n].config(self).max_draft_tokens
              for n in names if isinstance(registry[n], EngineMethod) and not registry[n].oracle]
        self.oracle_k = max(ks) if ks else None

    def generate_kwargs(self, max_new: int) -> dict:
        kw = dict(max_new_tokens=max_new, pad_token_id=self.pad_id, do_sample=self.cfg.sample)
        if self.cfg.sample:
            kw.update(sampling_kwargs(self.cfg.temperature, self.cfg.top_p))
        return kw

    @torch.no_grad()
    def timed_generate(self, batch: Batch, max_new: int, **extra) -> tuple[list[list[int]], float]:
        ids, mask = batch.input_ids.to(self.device), batch.attention_mask.to(self.device)
        if self.cfg.sample:
            torch.manual_seed(self.cfg.seed)
        kwargs = {**self.generate_kwargs(max_new), **extra}
        out, seconds = timed(lambda: self.model.generate(ids, attention_mask=mask, **kwargs), self.device,
                             self.model)
        new = out[:, ids.shape[1]:].tolist()
        return [trim_at_eos(row, self.eos_ids) for row in new], seconds


def _num_layers(model) -> int:
    from ..arch import adapter_for

    return adapter_for(model).num_layers


def load_selfspec_setup(model, cfg: BenchConfig):
    """(config, heads {E: head}, where they came from) for the `selfspec` method; CLI overrides applied."""
    import selfspec
    from ..pretrained import shipped_dir  # selfspec/assets/<model>/ when the package ships heads for it

    directory = cfg.heads or shipped_dir(str(cfg.model))
    heads, source = {}, "none found: selfspec == selfspec-untrained (pass --heads DIR)"
    config = SelfSpecConfig()
    if directory is not None:
        if not (Path(directory) / "selfspec_config.json").is_file():
            raise FileNotFoundError(f"--heads {directory!r}: no selfspec_config.json there; pass a directory "
                                    f"written by model.selfspec.save_pretrained or by selfspec train-heads.")
        try:
            selfspec.wrap(model, str(directory))  # loads config and heads once; methods re-add them per call
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError(f"--heads {directory!r}: loading heads needs {err.name}, missing in this "
                                      f"checkout; run without --heads until head loading lands.") from err
        config, heads = model.selfspec.config, dict(model.selfspec.heads)
        source = str(directory) if cfg.heads else f"shipped with selfspec (assets/{Path(directory).name})"
        selfspec.unwrap(model)
    overrides = {k: v for k, v in (("exit_layer", cfg.exit_layer), ("max_draft_tokens", cfg.max_draft_tokens))
                 if v is not None}
    return config.replace(**overrides).validate(_num_layers(model)), heads, source


def hf_exit_candidates(cfg: BenchConfig, num_layers: int, selfspec_exit: int) -> list[int]:
    wanted = cfg.hf_exit_layers or (round(num_layers / 4), round(num_layers / 2), round(3 * num_layers / 4),
                                    selfspec_exit)
    bad = [e for e in wanted if not 1 <= e <= num_layers - 1]
    if cfg.hf_exit_layers and bad:
        raise ValueError(f"--hf-exit-layers {bad} out of range: choose layers in [1, {num_layers - 1}].")
    return sorted({e for e in wanted if 1 <= e <= num_layers - 1})


# --- running --------------------------------------------------------------------------------------------------
@dataclass
class Record:
    method: str
    category: str
    question_ids: list
    prompt_tokens: list
    new_tokens: int
    seconds: float
    verify_steps: int | None
    drafted: int | None
    accepted: int | None
    exact: bool | None  # None in sampling mode
    # {question_id, index, got, expected} per differing row, with its verdict (near-tie / differs), the plain
    # model's logit gap and its 1-token vs multi-token discrepancy there
    mismatches: list = field(default_factory=list)
    outputs: list | None = None  # token rows, kept for the baseline and for mismatches
    rounds: int | None = None  # oracle only: runs until it drafted its own output


def compare_rows(batch: Batch, rows: list[list[int]], reference: list[list[int]],
                 judge_row: Callable | None = None) -> list[dict]:
    """One entry per row that differs from the reference; `judge_row(b, got, want)` adds its verdict."""
    out = []
    for b, (qid, got, want) in enumerate(zip(batch.question_ids, rows, reference)):
        i = first_difference(got, want)
        if i is None:
            continue
        entry = {"question_id": qid, "index": i, "got": got[i] if i < len(got) else None,
                 "expected": want[i] if i < len(want) else None, "verdict": DIFFERS}
        if judge_row is not None:
            entry.update(judge_row(b, got, want).to_dict())
            entry["verdict"] = entry.pop("kind")
        out.append(entry)
    return out


def make_record(name: str, batch: Batch, outcome: Outcome, reference, sample: bool,
                judge_row: Callable | None = None) -> Record:
    mismatches = [] if sample or reference is None else compare_rows(batch, outcome.rows, reference, judge_row)
    keep = name == BASELINE or bool(mismatches)
    return Record(name, batch.category, list(batch.question_ids), batch.prompt_tokens,
                  sum(len(r) for r in outcome.rows), outcome.seconds, outcome.verify_steps, outcome.drafted,
                  outcome.accepted, None if sample else not mismatches, mismatches,
                  outcome.rows if keep else None, outcome.rounds)


def method_order(names: list[str], index: int) -> list[str]:
    """Baseline first (the oracle needs its output), the others rotated by prompt so order effects average out."""
    rest = names[1:]
    k = index % len(rest) if rest else 0
    return [names[0]] + rest[k:] + rest[:k]


def run_batch(h: Harness, registry: dict, names: list[str], batch: Batch, max_new: int, index: int = 0,
              on_done: Callable[[Record], None] | None = None) -> list[Record]:
    records, reference = [], None
    for name in method_order(names, index):
        outcome = registry[name].run(h, batch, reference, max_new)
        if name == BASELINE:
            reference = outcome.rows
        judge_row = h.row_judge(batch, max_new, registry[name].verify_chunk(h))
        record = make_record(name, batch, outcome, reference, h.cfg.sample, judge_row)
        records.append(record)
        if on_done is not None:
            on_done(record)
    return records


def tune_hf_exit(h: Harness, registry: dict, batches: list[Batch], candidates: list[int],
                 keep: float = 0.8) -> dict[int, float]:
    """tokens/s of hf-early-exit at each candidate E on the tuning prompts; sets h.hf_exit_layer to the best.
    Every candidate runs the first prompt, and only those within `keep` of the fastest there run the rest: a deep
    exit drafts at a fraction of a shallow one's pace, and timing it on every prompt would spend the most on the
    choice that is never made. Each speed is over the prompts that candidate ran."""
    runs: dict[int, list[Outcome]] = {e: [] for e in candidates}
    alive = list(candidates)
    for i, batch in enumerate(batches):
        for e in alive:
            h.hf_exit_layer = e
            runs[e].append(registry["hf-early-exit"].run(h, batch, None, h.cfg.tune_tokens))
        if i == 0:
            first = {e: _tokens_per_s(runs[e]) for e in alive}
            alive = [e for e in alive if first[e] >= keep * max(first.values())]
    speeds = {e: _tokens_per_s(outcomes) for e, outcomes in runs.items()}
    h.hf_exit_layer = max(alive, key=speeds.get)
    return speeds


def _tokens_per_s(outcomes: list[Outcome]) -> float:
    return sum(sum(map(len, o.rows)) for o in outcomes) / max(sum(o.seconds for o in outcomes), 1e-9)


def report_mismatch(record: Record) -> None:
    for m in record.mismatches:
        why = ""
        if m.get("gap") is not None:
            why = f"; plain model's logit gap {m['gap']:.3f}, 1-token vs multi-token discrepancy {m['discrepancy']:.3f}"
        flag = "!! DIFFERS" if m["verdict"] == DIFFERS else "near-tie"
        _log(f"{flag}: {record.method} parts from {BASELINE} on {record.category} question {m['question_id']} at "
             f"generated token {m['index']} (got {m['got']}, expected {m['expected']}{why})")


def _log(message: str) -> None:
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)


@dataclass
class BenchResult:
    names: list[str]
    records: list[Record]
    summary: dict  # category (and "overall") -> method -> Row as dict
    setup: dict  # what the harness chose: selfspec config, heads, hf-early-exit E and its tuning, skipped
    mismatches: list[dict]
    wall_seconds: float
    stopped: str | None = None  # why the run ended before its last prompt; its tables cover the prompts done
    interrupted: bool = False  # stopped by a signal (not by its time budget)


def run_bench(model, workload: Workload, cfg: BenchConfig, pad_id: int, eos_ids: list[int],
              registry: dict[str, Method] | None = None, deadline: float | None = None) -> BenchResult:
    """Warm up, tune hf-early-exit's E on the tuning prompts, then run every method on every batch; with a
    `deadline` (time.monotonic), a batch that would end past it at the pace of those before is not started."""
    from tqdm import tqdm

    registry = METHODS if registry is None else registry
    start = time.perf_counter()
    names, skipped = select_methods(cfg, registry)
    h = Harness(model, cfg, pad_id, eos_ids)
    h.bound_oracle(registry, names)
    for name, why in skipped.items():
        _log(f"note: skipping {name}: {why}")
    longest = max(b.input_ids.shape[1] for b in [workload.warmup, *workload.batches]) + cfg.max_new_tokens
    warm_up = {n: registry[n].warm_up(h, longest) for n in names if isinstance(registry[n], EngineMethod)}
    run_batch(h, registry, names, workload.warmup, cfg.warmup_tokens)
    compiled_before = compiled_so_far(model)
    tuning = {}
    if "hf-early-exit" in names:
        candidates = hf_exit_candidates(cfg, h.num_layers, h.base_config.exit_layer)
        tuning = tune_hf_exit(h, registry, workload.tune or [workload.warmup], candidates)
    records = []
    with tqdm(total=len(workload.batches) * len(names), desc="bench", unit="run", file=sys.stderr) as bar:
        def done(record: Record) -> None:
            report_mismatch(record)
            bar.set_postfix_str(f"{record.category}/{record.method}")
            bar.update(1)

        stopped, interrupted, t_batches = None, False, time.monotonic()
        for i, batch in enumerate(workload.batches):
            if deadline is not None and i and time.monotonic() + (time.monotonic() - t_batches) / i > deadline:
                stopped = f"stopped by its time budget after {i} of {len(workload.batches)} batches"
                bar.total = bar.n  # the bar ends where the run does
                bar.refresh()
                break
            try:
                records += run_batch(h, registry, names, batch, cfg.max_new_tokens, i, done)
            except KeyboardInterrupt:
                if not records:
                    raise  # nothing measured yet: nothing to report
                # a batch's runs count only together (each method on the same prompts), so the one cut off goes
                stopped = f"stopped by an interrupt after {i} of {len(workload.batches)} batches"
                interrupted = True
                break
    categories = list(dict.fromkeys(r.category for r in records))
    setup = {"selfspec_config": h.base_config.to_dict(), "heads": sorted(h.heads), "heads_source": h.heads_source,
             "hf_early_exit_layer": h.hf_exit_layer if "hf-early-exit" in names else None,
             "hf_early_exit_tuning_tokens_per_s": {str(k): v for k, v in tuning.items()},
             "num_layers": h.num_layers, "skipped_methods": skipped,
             "engine_settings": {n: engine_settings(registry[n].config(h))
                                 for n in names if isinstance(registry[n], EngineMethod)},
             "methods": {n: registry[n].description for n in names},
             "warm_up_seconds": {n: round(s, 1) for n, s in warm_up.items() if s},
             "compiled_after_warm_up": {k: v - compiled_before[k] for k, v in compiled_so_far(model).items()}}
    mismatches = [{"method": r.method, "category": r.category, **m} for r in records for m in r.mismatches]
    return BenchResult(names, records, summarize(records, names, categories), setup, mismatches,
                       time.perf_counter() - start, stopped, interrupted)


# --- command line ---------------------------------------------------------------------------------------------
def _words(values) -> tuple:
    """`--x a b` and `--x a,b` alike."""
    return tuple(w for v in values or () for w in v.split(",") if w)


def build_parser() -> argparse.ArgumentParser:
    d = BenchConfig()
    p = argparse.ArgumentParser(
        prog="selfspec bench", description="Spec-Bench-style benchmark: selfspec against Hugging Face's own "
        "methods and an oracle drafter, on the same prompts, weights and device.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=d.model, help="short name (smollm2-135m), local HF directory or hub id")
    p.add_argument("--prompts", default=None, help="Spec-Bench-format JSONL (first turn used) (default: the "
                   "Spec-Bench questions shipped with selfspec)%(default).0s")
    p.add_argument("--categories", nargs="+", default=None, help=f"categories to run (default: the eval split "
                   f"{list(EVAL_CATEGORIES)} of Spec-Bench, or every category of --prompts)%(default).0s")
    p.add_argument("--limit", type=int, default=None, help="prompts per category (default: all)%(default).0s")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="new tokens per prompt")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="prompts per generate call; HF's "
                   "assisted methods are skipped above 1")
    p.add_argument("--methods", nargs="+", default=None, help=f"subset of {list(METHODS)} (default: "
                   f"{list(CORE_METHODS)} plus registered n-gram/hybrid drafters)%(default).0s")
    p.add_argument("--exit-layer", type=int, default=None,
                   help="selfspec exit layer E (default: the config's)%(default).0s")
    p.add_argument("--max-draft-tokens", type=int, default=None,
                   help="selfspec draft length K, also the oracle's (default: the config's)%(default).0s")
    p.add_argument("--heads", default=None, help="directory with selfspec_config.json and trained heads for the "
                   "'selfspec' method (default: shipped ones when present)%(default).0s")
    p.add_argument("--hf-exit-layers", nargs="+", default=None, help="candidate E for hf-early-exit, the fastest "
                   "on train-split prompts is used (default: L/4, L/2, 3L/4 and selfspec's E)%(default).0s")
    p.add_argument("--prompt-lookup-tokens", type=int, default=d.prompt_lookup_tokens, help="N of hf-prompt-lookup")
    p.add_argument("--sample", action="store_true",
                   help="sample instead of greedy (speed and acceptance only)%(default).0s")
    p.add_argument("--greedy-and-sampled", action="store_true",
                   help="run the bench greedy, then sampled (--temperature, --top-p), on the model loaded once: "
                        "OUTPUT/greedy and OUTPUT/sampled%(default).0s")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature, with --sample")
    p.add_argument("--top-p", type=float, default=d.top_p,
                   help="nucleus sampling's top_p, with --sample (default: 1.0, the whole distribution)")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed for --sample")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "bfloat16", "float16", "float32"],
                   help="model precision; auto = the checkpoint's dtype, for the embedded model bfloat16 where the "
                        "CPU/GPU computes it in hardware, else float32")
    p.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's)%(default).0s")
    p.add_argument("--compile", action="store_true",
                   help="every selfspec method runs compiled (selfspec/compiled.py), its compile time left out of its "
                        "time; the -compiled methods do so one by one")
    p.add_argument("--no-chat-template", action="store_true",
                   help="render prompts as plain dialogue (User: / Assistant:) even where the tokenizer has a chat "
                        "template; without one they are rendered so anyway%(default).0s")
    p.add_argument("--warmup-tokens", type=int, default=d.warmup_tokens,
                   help="tokens each method generates once, untimed, before the timed runs")
    p.add_argument("--tune-tokens", type=int, default=d.tune_tokens, help="tokens per prompt when choosing E")
    p.add_argument("--output", default=None,
                   help=f"output directory (default: {DEFAULT_OUTPUT_ROOT}/<model>-<time>)%(default).0s")
    p.add_argument("--strict", action="store_true",
                   help="exit with status 1 when an output differs from hf-greedy's other than at a near-tie "
                        "(a bug)%(default).0s")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole command: a batch of prompts that would end past them is not started, "
                        "and the report says how many ran%(default).0s")
    add_report_arguments(p)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 1), ("--batch-size", args.batch_size, 1),
                             ("--limit", args.limit, 1), ("--prompt-lookup-tokens", args.prompt_lookup_tokens, 1),
                             ("--threads", args.threads, 1), ("--warmup-tokens", args.warmup_tokens, 1),
                             ("--tune-tokens", args.tune_tokens, 1), ("--time-budget", args.time_budget, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}.")
    if args.temperature <= 0:
        raise ValueError(f"--temperature must be > 0, got {args.temperature} (greedy is the default without "
                         f"--sample).")
    if args.sample and args.greedy_and_sampled:
        raise ValueError("--greedy-and-sampled runs the sampled bench after the greedy one; drop --sample.")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p} (1.0 keeps the whole distribution).")
    try:
        hf_exits = tuple(int(w) for w in _words(args.hf_exit_layers))
    except ValueError:
        raise ValueError(f"--hf-exit-layers takes integers, got {args.hf_exit_layers}.") from None
    return BenchConfig(
        model=args.model, prompts=args.prompts, categories=_words(args.categories) or None, limit=args.limit,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, methods=_words(args.methods),
        exit_layer=args.exit_layer, max_draft_tokens=args.max_draft_tokens, heads=args.heads,
        hf_exit_layers=hf_exits, prompt_lookup_tokens=args.prompt_lookup_tokens, sample=args.sample,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, warmup_tokens=args.warmup_tokens,
        tune_tokens=args.tune_tokens, dtype=args.dtype, device=args.device, threads=args.threads,
        compile=args.compile, chat_template=not args.no_chat_template, output=args.output, strict=args.strict,
        time_budget=args.time_budget)


def default_output(cfg: BenchConfig) -> Path:
    return Path(DEFAULT_OUTPUT_ROOT) / f"{Path(str(cfg.model)).name}-{time.strftime('%Y%m%d-%H%M%S')}"


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # --time-budget counts from here
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.report or args.update:
        return main_report(args)
    try:
        cfg = config_from_args(args)
        check_categories(cfg)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        from ..models import resolve_model

        model, tokenizer = resolve_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
        workload = build_workload(tokenizer, cfg)
        select_methods(cfg, METHODS)
        load_selfspec_setup(model, cfg)  # bad --heads / --exit-layer fail here, before any prompt runs
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        print(f"selfspec bench: error: {err}", file=sys.stderr)
        return 2
    deadline = started + cfg.time_budget if cfg.time_budget else None
    if not args.greedy_and_sampled:
        return run_and_write(model, tokenizer, workload, cfg, argv, cfg.output or default_output(cfg), deadline)
    root = cfg.output or default_output(cfg)
    codes = [run_and_write(model, tokenizer, workload, replace(cfg, sample=sample), argv, os.path.join(root, mode))
             for sample, mode in ((False, "greedy"), (True, "sampled"))]
    return max(codes)


def run_and_write(model, tokenizer, workload, cfg: BenchConfig, argv: list[str], output: str,
                  deadline: float | None = None) -> int:
    """One bench run over the workload in cfg's decoding mode, its outputs written to `output`; the exit code."""
    from ..models import dtype_name

    device = next(model.parameters()).device
    loadavg_start = loadavg()
    with sigterm_as_interrupt():
        result = run_bench(model, workload, cfg, tokenizer.pad_token_id, eos_ids_of(model, tokenizer),
                           deadline=deadline)
    meta = {"command": "selfspec bench " + shlex.join(argv), "machine": {**machine_info(device),
            "loadavg_start": loadavg_start, "loadavg_end": loadavg()}, "versions": versions(),
            "model": {"name": cfg.model, "class": type(model).__name__, "dtype": dtype_name(model.dtype),
                      **step_speedups(model), "parameters": sum(p.numel() for p in model.parameters())},
            "settings": asdict(cfg)}
    paths = write_outputs(result, meta, output)
    print(render_markdown(result, meta))
    print(f"wrote {paths['md']}, {paths['json']}, {paths['png']}")
    if result.mismatches:
        print(exactness_line(result), file=sys.stderr)
    if result.stopped:
        print(f"selfspec bench: {result.stopped}", file=sys.stderr)
    if result.interrupted:
        return 130  # the shell's code for a run stopped by an interrupt
    differs = any(m["verdict"] == DIFFERS for m in result.mismatches)
    return 1 if (cfg.strict and differs) else 0


if __name__ == "__main__":
    sys.exit(main())
