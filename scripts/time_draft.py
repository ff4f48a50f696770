"""Where a speculative step's time goes, by wall clock around each part of the early-exit drafter and the loop.

    OMP_NUM_THREADS=1 python scripts/time_draft.py --threads 1                        # shipped heads and config
    OMP_NUM_THREADS=1 python scripts/time_draft.py --heads DIR --depth 5 --threshold 0 --threads 1
    OMP_NUM_THREADS=1 python scripts/time_draft.py --threads 1 --depth 4 --threshold 0.1 --tree-top-k 2 --tree-size 6

Greedy generations on Spec-Bench eval prompts (one per category) with the early_exit drafter, in chains or, with
--tree-top-k > 1, in trees. Each part (layers [0, E), the head's MLP, its draft-vocabulary logits with the copy
logit, the copy lookup, the draft choice or a tree's growth; then the verify pass over layers [E, L), the LM
head with the verdict, the prefill) is timed with perf_counter around the function the loop or the drafter calls,
so the sums include Python; no profiler, whose per-op cost would inflate the small parts. Prints each part's mean
per call and per verify step.
"""
from __future__ import annotations

import argparse
import collections
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--heads", default=None, help="heads directory (default: the shipped ones)")
    p.add_argument("--depth", type=int, default=None, help="max_draft_tokens (default: the config's chain)")
    p.add_argument("--threshold", type=float, default=None, help="draft_confidence_threshold (default: config's)")
    p.add_argument("--exit-layer", type=int, default=None)
    p.add_argument("--tree-top-k", type=int, default=1, help="draft_tree_top_k (1: chains)")
    p.add_argument("--tree-size", type=int, default=None, help="draft_tree_size, with --tree-top-k > 1")
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--pack-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="selfspec.load's packing of bf16 CPU weights (default: where there are such weights)")
    return p.parse_args(argv)


class PartTimer:
    """Wall seconds and calls per labelled function, gathered by wrapping the attribute where the drafter finds it."""

    def __init__(self):
        self.seconds, self.calls = collections.defaultdict(float), collections.Counter()

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self.seconds[label] += time.perf_counter() - start
            self.calls[label] += 1
            return out

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


@torch.no_grad()
def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import selfspec
    from selfspec import decoding
    from selfspec.drafters import early_exit
    from selfspec.prompts import chat_input_ids, load_prompts

    overrides = {"drafter": "early_exit", "draft_tree_top_k": args.tree_top_k}
    for key, value in (("max_draft_tokens", args.depth), ("draft_confidence_threshold", args.threshold),
                       ("exit_layer", args.exit_layer), ("draft_tree_size", args.tree_size)):
        if value is not None:
            overrides[key] = value
    model, tok = selfspec.load(args.model, heads=args.heads, pack_weights=args.pack_weights, **overrides)
    if args.depth is None and args.threshold is None:  # the calibrated setting, as bench's selfspec rows run it
        key = "early_exit" if args.tree_top_k == 1 else "early_exit-tree"
        setting = model.selfspec.config.metadata.get("calibration", {}).get("per_drafter", {}).get(key, {})
        model.selfspec.config = model.selfspec.config.replace(**setting)
    timer = PartTimer()
    for owner, name, label in ((early_exit, "forward_early", "layers [0, E)"),
                               (early_exit.TopStates, "normed", "head MLP (top-reading)"),
                               (early_exit.CopyPaths, "candidates", "copy lookup"),
                               (early_exit, "draft_scores", "draft-vocabulary logits + copy logit"),
                               (early_exit, "choose_draft", "draft choice (chains)"),
                               (early_exit, "grow_tree", "tree growth, all levels (trees)"),
                               (early_exit.EarlyExitDrafter, "propose", "whole proposal"),
                               (decoding, "verify", "verify pass, layers [E, L)"),
                               (decoding, "choose", "LM head + verdict"),
                               (decoding, "prefill", "prefill")):
        timer.wrap(owner, name, label)
    prompts = [chat_input_ids(tok, p.text) for p in load_prompts(None, split="eval", limit_per_category=1)]
    prompts = prompts[: args.prompts]
    model.generate(prompts[0], attention_mask=torch.ones_like(prompts[0]), max_new_tokens=8)  # warm-up
    timer.reset()
    steps, new, start = 0, 0, time.perf_counter()
    for ids in prompts:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens)
        steps, new = steps + model.selfspec.last_stats.verify_steps, new + model.selfspec.last_stats.new_tokens
    wall = time.perf_counter() - start
    c = model.selfspec.config
    shape = "chain" if c.draft_tree_top_k == 1 else f"tree top-{c.draft_tree_top_k} of {c.draft_tree_size}"
    print(f"{args.model} {model.dtype}, {shape} E={c.exit_layer} depth {c.max_draft_tokens} threshold "
          f"{c.draft_confidence_threshold}, {len(prompts)} prompts, {new} tokens in {steps} verify steps "
          f"({new / steps:.2f} a step), {torch.get_num_threads()} thread(s)")
    proposal = timer.seconds["whole proposal"]
    print(f"per step {1e3 * wall / steps:.1f} ms, of which drafting {1e3 * proposal / steps:.1f} ms and the rest "
          f"(verify, accept, prefill share) {1e3 * (wall - proposal) / steps:.1f} ms")
    print(f"  {'part':38s} {'per call':>9s} {'calls':>6s} {'per step':>9s}")
    for label in timer.seconds:
        seconds, calls = timer.seconds[label], timer.calls[label]
        print(f"  {label:38s} {1e3 * seconds / calls:6.2f} ms {calls:6d} {1e3 * seconds / steps:6.2f} ms")


if __name__ == "__main__":
    main()
