"""Where a selfspec decoding step's time goes: the model's own compute against the engine around it.

    OMP_NUM_THREADS=1 python scripts/profile_step.py --threads 1                  # bf16 where the CPU has it
    python scripts/profile_step.py --drafter ngram --dtype float32 --new-tokens 64 --table 15
    python scripts/profile_step.py --drafter early_exit --heads shipped --tree-top-k 4 --tree-size 16 --depth 5

Runs one greedy generate on a Spec-Bench eval prompt under torch.profiler. The adapter's calls into the model
(embedding, each decoder layer, final norm, LM head) are labelled with record_function, so the profile splits
wall time into the model's compute and everything else: the loop's bookkeeping (masks, slot table, acceptance,
rollback), the drafter's own logic, and Python. Prints that split per verify step and torch's op table.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch

MODEL_LABEL = "model"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--drafter", default="none", help="none (verify steps only), ngram, early_exit, hybrid")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--table", type=int, default=0, help="rows of torch's op table to print (0: none)")
    p.add_argument("--pack-weights", action="store_true", help="selfspec.pack_weights first (bf16 on CPU)")
    p.add_argument("--heads", default=None, help="heads directory, or 'shipped' (default: untrained exits)")
    # each of these left out keeps the config's value (the heads directory's, else the default)
    p.add_argument("--depth", type=int, dest="max_draft_tokens", help="max_draft_tokens")
    p.add_argument("--tree-top-k", type=int, dest="draft_tree_top_k", help="draft_tree_top_k (1: chains)")
    p.add_argument("--tree-size", type=int, dest="draft_tree_size", help="draft_tree_size")
    p.add_argument("--threshold", type=float, dest="draft_confidence_threshold", help="draft_confidence_threshold")
    return p.parse_args(argv)


def label_model_calls(adapter) -> None:
    """Wrap the adapter's model calls in a record_function so the profile can tell them apart."""
    for name in ("embed", "rotary", "call_module", "final_norm", "logits"):
        original = getattr(adapter, name)

        def labelled(*args, _original=original, **kwargs):
            with torch.profiler.record_function(MODEL_LABEL):
                return _original(*args, **kwargs)

        setattr(adapter, name, labelled)


def model_seconds(prof) -> float:
    """Wall seconds spent inside the labelled model calls (outermost labels only)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.name == MODEL_LABEL)
    total, reach = 0, None
    for start, end in spans:  # nested labels (a layer call inside another) are merged
        if reach is None or start >= reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total / 1e6


@torch.no_grad()
def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import selfspec
    from selfspec.models import resolve_model
    from selfspec.pretrained import shipped_dir
    from selfspec.prompts import chat_input_ids, load_prompts

    model, tok = resolve_model(args.model, dtype=args.dtype)
    if args.pack_weights:
        selfspec.pack_weights(model)
    heads = str(shipped_dir(args.model)) if args.heads == "shipped" else args.heads
    knobs = ("max_draft_tokens", "draft_tree_top_k", "draft_tree_size", "draft_confidence_threshold")
    overrides = {k: getattr(args, k) for k in knobs if getattr(args, k) is not None}
    selfspec.wrap(model, heads, drafter=args.drafter, **overrides)
    label_model_calls(model.selfspec.adapter)
    prompt = load_prompts(None, split="eval", limit_per_category=1)[0]
    ids = chat_input_ids(tok, prompt.text)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False)
    model.generate(ids, **{**kwargs, "max_new_tokens": 8})  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        wall = time.perf_counter() - start
    stats = model.selfspec.last_stats
    inside = model_seconds(prof)
    steps = stats.verify_steps
    c = model.selfspec.config
    print(f"{args.model} {model.dtype}, drafter {args.drafter} (E={c.exit_layer}, K={c.max_draft_tokens}, tree top-"
          f"{c.draft_tree_top_k} of {c.draft_tree_size}), mean accepted {stats.mean_accepted_tokens:.2f}, prompt {ids.shape[1]} tokens, {stats.new_tokens} new "
          f"tokens in {steps} full passes (prefill included), {torch.get_num_threads()} thread(s), profiled")
    print(f"wall {wall * 1e3:.1f} ms = model compute {inside * 1e3:.1f} ms ({inside / wall:.1%}) + engine and "
          f"Python {(wall - inside) * 1e3:.1f} ms ({1 - inside / wall:.1%}); per step {wall / steps * 1e3:.2f} ms, "
          f"of which outside the model {(wall - inside) / steps * 1e3:.2f} ms")
    if args.table:
        with contextlib.suppress(Exception):
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.table))


if __name__ == "__main__":
    main()
