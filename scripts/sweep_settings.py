"""Mean accepted tokens and tokens/s of several drafting settings on the same eval-split prompts, one model load.

    OMP_NUM_THREADS=1 python scripts/sweep_settings.py --threads 1 --limit 2 --new-tokens 96 \
        '{"drafter": "early_exit", "max_draft_tokens": 2, "draft_confidence_threshold": 0.2}' \
        '{"drafter": "early_exit", "max_draft_tokens": 5, "draft_confidence_threshold": 0.05,
          "draft_tree_top_k": 4, "draft_tree_size": 14}'

    OMP_NUM_THREADS=1 python scripts/sweep_settings.py --threads 1 --mt-bench-turns 1 2 --new-tokens 64 SETTINGS

Each argument is a JSON object of SelfSpecConfig fields laid over the heads' config (the shipped one by default).
Greedy; acceptance and drafted tokens a step (a tree's nodes) are what `generate` reports, and head passes a step
(the drafter's runs through layers [0, E) and its head) are counted here, so none of them depends on load. The
settings take turns prompt by prompt (each prompt runs under every setting before the next prompt), so that load
drifting on a shared machine hits them alike and their tokens/s compare side by side; still a quick
look at a trade-off, not a benchmark (`selfspec bench` also times plain `generate` and judges every output).

With --by-category each setting's counts also come per Spec-Bench category, as a markdown table.

With --mt-bench-turns the prompts are the calibration's instead (one MT-bench question per category, each turn
asked as `selfspec calibrate` asks it: measure.turns), plain `generate` takes its turn beside the settings, and
each turn gets its own lines with speeds relative to plain.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("settings", nargs="+", type=json.loads, help="JSON objects of config fields")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--heads", default=None, help="heads directory (default: the shipped ones)")
    p.add_argument("--limit", type=int, default=2, help="eval-split prompts per category")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--mt-bench-turns", type=int, nargs="+", choices=[1, 2], default=None,
                   help="time the calibration's MT-bench turns (1, 2 or both) instead of the eval split")
    p.add_argument("--answer-tokens", type=int, default=128, help="with --mt-bench-turns: the first answer's length")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--by-category", action="store_true",
                   help="also print each setting's counts per Spec-Bench category (where the drafts pay)")
    return p.parse_args(argv)


@dataclasses.dataclass
class Tally:
    """One setting's totals over the prompts run so far."""

    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    passes: int = 0
    seconds: float = 0.0

    def add(self, stats, passes: int, seconds: float) -> None:
        self.tokens, self.steps = self.tokens + stats.new_tokens, self.steps + stats.verify_steps
        self.drafted, self.seconds = self.drafted + stats.drafted_tokens, self.seconds + seconds
        self.passes += passes

    def counts(self) -> str:
        """tokens / drafts / head passes a step, for the per-category table"""
        return f"{self.tokens / self.steps:.2f} / {self.drafted / self.steps:.2f} / {self.passes / self.steps:.2f}"

    def line(self) -> str:
        """mean accepted tokens per verify step, drafted tokens (tree nodes) and head passes per step, tokens/s"""
        return (f"mean accepted {self.tokens / self.steps:.3f}  drafted {self.drafted / self.steps:5.2f}  "
                f"head passes {self.passes / self.steps:4.2f}  tok/s {self.tokens / self.seconds:6.2f}")


HEAD_PASSES = [0]  # the drafter's runs through layers [0, E), counted by count_head_passes


def count_head_passes() -> None:
    """Count every run of the early-exit drafter (its own and the hybrid's) through layers [0, E): what a drafted
    token costs, apart from the lookups, which cost no pass."""
    import selfspec.drafters.early_exit as early_exit

    forward_early = early_exit.forward_early

    def counted(*args, **kwargs):
        HEAD_PASSES[0] += 1
        return forward_early(*args, **kwargs)

    early_exit.forward_early = counted


def run_prompt(model, batch, new_tokens: int, tallies: tuple) -> None:
    """One greedy generate with the model's current config, added to each of `tallies` (overall, category)."""
    passes, start = HEAD_PASSES[0], time.perf_counter()
    model.generate(batch.input_ids, attention_mask=batch.attention_mask, max_new_tokens=new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    for tally in tallies:
        tally.add(model.selfspec.last_stats, HEAD_PASSES[0] - passes, seconds)


def run_plain(model, batch, new_tokens: int, tally: Tally) -> None:
    """One greedy plain `generate` (Hugging Face's own, as calibrate times it), added to `tally`'s tokens and
    seconds."""
    from selfspec.tools.calibrate.trials import generate_once

    start = time.perf_counter()
    tally.tokens += generate_once(model, batch.input_ids, new_tokens, plain=True).numel()
    tally.seconds += time.perf_counter() - start


def print_categories(by_category: dict, settings: int) -> None:
    """A markdown table: a row per category, a column per setting (in the order given), tokens / drafts / head
    passes a step in each cell."""
    print("| category | " + " | ".join(f"setting {i + 1}" for i in range(settings)) + " |")
    print("|---" * (settings + 1) + "|")
    for category, tallies in by_category.items():
        print(f"| {category} | " + " | ".join(t.counts() for t in tallies) + " |")


def mt_bench_batches(model, tok, turns: list[int], answer_tokens: int) -> dict[int, list]:
    """{turn: batches} of the calibration's MT-bench questions (one per category), asked as calibrate asks them."""
    from selfspec.tools.bench import Batch
    from selfspec.tools.calibrate.space import MeasureSpec
    from selfspec.tools.calibrate.trials import encode_turns, load_calibration_prompts

    questions = load_calibration_prompts(None, 8)
    out = {}
    for turn in turns:
        ids = encode_turns(model, tok, questions, MeasureSpec(turns=[turn], answer_tokens=answer_tokens), "cpu")
        out[turn] = [Batch("mt_bench", [q.question_id], x, torch.ones_like(x)) for q, x in zip(questions, ids)]
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import selfspec
    from selfspec.prompts import load_prompts
    from selfspec.tools.bench import make_batches

    count_head_passes()
    extra = {"heads": args.heads} if args.heads else {}
    model, tok = selfspec.load(args.model, dtype=getattr(torch, args.dtype), **extra)
    engine = model.selfspec
    base = engine.config
    if args.mt_bench_turns:
        sets = {f"MT-bench turn {t}": b for t, b in mt_bench_batches(model, tok, args.mt_bench_turns,
                                                                     args.answer_tokens).items()}
    else:
        sets = {"eval split": make_batches(tok, load_prompts(split="eval", limit_per_category=args.limit), 1)}
    packed = ", packed weights" if selfspec.packing.is_packed(model) else ""  # selfspec.load packs bf16 on CPU
    print(f"{sum(map(len, sets.values()))} prompts x {args.new_tokens} tokens, {args.dtype}{packed}, "
          f"{torch.get_num_threads()} thread(s)")
    configs = [dataclasses.replace(base, **s).validate(engine.adapter.num_layers) for s in args.settings]
    for name, batches in sets.items():
        plain, tallies = Tally(), [Tally() for _ in configs]
        by_category = {}  # category -> one Tally per setting
        for batch in batches:
            if args.mt_bench_turns:
                run_plain(model, batch, args.new_tokens, plain)
            mine = by_category.setdefault(batch.category, [Tally() for _ in configs])
            for config, tally, part in zip(configs, tallies, mine):
                engine.config = config
                run_prompt(model, batch, args.new_tokens, (tally, part))
        if args.mt_bench_turns:
            print(f"{name}: plain generate {plain.tokens / plain.seconds:.2f} tok/s")
        for setting, tally in zip(args.settings, tallies):
            ratio = f"  {tally.tokens / tally.seconds / (plain.tokens / plain.seconds):.2f}x" if plain.seconds else ""
            print(f"{tally.line()}{ratio}  {json.dumps(setting)}")
        if args.by_category:
            print_categories(by_category, len(configs))


if __name__ == "__main__":
    main()
