"""Chains of a copy head with and without guessed inputs, side by side: the same drafts, fewer draft passes.

    OMP_NUM_THREADS=1 python scripts/measure_guesses.py --threads 1
    OMP_NUM_THREADS=1 python scripts/measure_guesses.py --heads DIR --depths 2 4 6 8 --threshold 0.2 --threads 1

Greedy generations on Spec-Bench eval prompts (`--per-category` of each category) with the early_exit drafter in
chains of each depth K, once guessing the inputs after the next one from the copy head's lookup and once drafting
one token a pass, interleaved prompt by prompt with plain `generate` so that load drifting on a shared machine
hits all alike. Prints tokens/s against plain generate, tokens per verify step, draft passes per step and the
share of drafts that guesses confirmed; the two variants of one K must accept the same tokens.
"""
from __future__ import annotations

import argparse
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--heads", default=None, help="heads directory (default: the shipped ones)")
    p.add_argument("--depths", type=int, nargs="+", default=[2, 4, 6, 8], help="max_draft_tokens to compare")
    p.add_argument("--threshold", type=float, default=0.2, help="draft_confidence_threshold")
    p.add_argument("--per-category", type=int, default=1, help="eval prompts per category")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def timed_generate(model, ids, new_tokens: int) -> tuple[int, float]:
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return out.shape[1] - ids.shape[1], time.perf_counter() - start


@torch.no_grad()
def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import selfspec
    from selfspec.drafters.early_exit import EarlyExitDrafter
    from selfspec.prompts import chat_input_ids, load_prompts

    model, tok = selfspec.load(args.model, heads=args.heads, drafter="early_exit", draft_tree_top_k=1,
                               draft_confidence_threshold=args.threshold)
    config, heads = model.selfspec.config, list(model.selfspec.heads.values())
    head = model.selfspec.head_for(config.exit_layer)
    selfspec.unwrap(model)  # plain generate between the chains: the same model object
    prompts = [chat_input_ids(tok, p.text)
               for p in load_prompts(None, split="eval", limit_per_category=args.per_category)]
    variants = [("plain", None, None)] + [(f"K={k} {'guess' if g else 'one a pass'}", k, g)
                                           for k in args.depths for g in (True, False)]
    totals = {name: [0, 0.0, 0, 0, 0] for name, _, _ in variants}  # tokens, seconds, steps, passes, guessed
    timed_generate(model, prompts[0], 8)  # warm-up
    for ids in prompts:
        for name, k, guess in variants:
            t = totals[name]
            if k is None:
                new, seconds = timed_generate(model, ids, args.new_tokens)
                totals[name] = [t[0] + new, t[1] + seconds, t[2] + new, 0, 0]
                continue
            selfspec.wrap(model, config.replace(max_draft_tokens=k))
            for h in heads:
                model.selfspec.add_head(h)
            drafter = EarlyExitDrafter(head, args.threshold, guess=guess)
            model.selfspec.drafter_override = drafter
            try:
                new, seconds = timed_generate(model, ids, args.new_tokens)
                stats = model.selfspec.last_stats
            finally:
                selfspec.unwrap(model)
            totals[name] = [t[0] + new, t[1] + seconds, t[2] + stats.verify_steps, t[3] + drafter.passes,
                            t[4] + drafter.guessed]
    plain = totals["plain"][0] / totals["plain"][1]
    print(f"{args.model} {model.dtype}, E={config.exit_layer}, threshold {args.threshold}, {len(prompts)} "
          f"eval prompts x {args.new_tokens} tokens, {torch.get_num_threads()} thread(s); plain {plain:.1f} tok/s")
    print("| chain | tok/s vs plain | tokens per step | draft passes per step | drafts from guesses |")
    print("|---|---|---|---|---|")
    for name, k, _ in variants[1:]:
        tokens, seconds, steps, passes, guessed = totals[name]
        drafted = passes + guessed
        print(f"| {name} | {tokens / seconds / plain:.2f}x | {tokens / steps:.2f} | {passes / steps:.2f} | "
              f"{guessed / max(drafted, 1):.0%} |")


if __name__ == "__main__":
    main()
