"""Mean accepted tokens and tokens/s of several drafting settings on the same eval-split prompts, one model load.

    OMP_NUM_THREADS=1 python scripts/sweep_settings.py --threads 1 --limit 2 --new-tokens 96 \
        '{"drafter": "early_exit", "max_draft_tokens": 2, "draft_confidence_threshold": 0.2}' \
        '{"drafter": "early_exit", "max_draft_tokens": 5, "draft_confidence_threshold": 0.05,
          "draft_tree_top_k": 4, "draft_tree_size": 14}'

Each argument is a JSON object of SelfSpecConfig fields laid over the heads' config (the shipped one by default).
Greedy; acceptance and drafted tokens a step (a tree's nodes) are what `generate` reports, so they do not depend
on load. Tokens/s are one pass per setting, one setting after another: a quick look at a trade-off, not a
benchmark (`selfspec bench` interleaves methods prompt by prompt and compares with plain `generate`).
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
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def run_setting(model, batches, new_tokens: int) -> tuple[float, float, float]:
    """(mean accepted tokens per verify step, drafted tokens (tree nodes) per step, tokens/s) over the batches
    with the model's current config."""
    tokens = steps = drafted = 0
    seconds = 0.0
    for batch in batches:
        start = time.perf_counter()
        model.generate(batch.input_ids, attention_mask=batch.attention_mask, max_new_tokens=new_tokens,
                       do_sample=False)
        seconds += time.perf_counter() - start
        stats = model.selfspec.last_stats
        tokens, steps = tokens + stats.new_tokens, steps + stats.verify_steps
        drafted += stats.drafted_tokens
    return tokens / steps, drafted / steps, tokens / seconds


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import selfspec
    from selfspec.prompts import load_prompts
    from selfspec.tools.bench import make_batches

    extra = {"heads": args.heads} if args.heads else {}
    model, tok = selfspec.load(args.model, dtype=getattr(torch, args.dtype), **extra)
    engine = model.selfspec
    base = engine.config
    batches = make_batches(tok, load_prompts(split="eval", limit_per_category=args.limit), 1)
    print(f"{len(batches)} prompts x {args.new_tokens} tokens, {args.dtype}, {torch.get_num_threads()} thread(s)")
    for setting in args.settings:
        engine.config = dataclasses.replace(base, **setting).validate(engine.adapter.num_layers)
        accepted, drafted, speed = run_setting(model, batches, args.new_tokens)
        print(f"mean accepted {accepted:.3f}  drafted {drafted:5.2f}  tok/s {speed:6.2f}  {json.dumps(setting)}",
              flush=True)


if __name__ == "__main__":
    main()
