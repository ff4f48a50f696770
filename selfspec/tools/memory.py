"""Peak memory of a wrapped generate against plain generate on the same long prompt, each in a fresh process.

    python -m selfspec.tools.memory --prompt-tokens 6000 --new-tokens 32        # both modes, a table
    python -m selfspec.tools.memory --mode wrapped --json                         # one mode, in this process

Each mode runs in its own interpreter (peak RSS is per process): load the model, one short warm-up generate,
then record RSS, run one generate on a prompt of --prompt-tokens tokens, record the process's peak RSS and the
RSS after the call returns (garbage collected). Linux only (/proc and ru_maxrss in KiB).
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys

MODES = ("plain", "wrapped")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES, default=None, help="run one mode here (default: both, each fresh)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--prompt-tokens", type=int, default=6000)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--drafter", default="ngram", help="selfspec drafter for the wrapped mode")
    p.add_argument("--json", action="store_true", help="print one JSON line (what the parent reads)")
    return p.parse_args(argv)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(args) -> dict:
    import torch

    import selfspec
    from selfspec.models import resolve_model

    torch.set_num_threads(1)
    model, _ = resolve_model(args.model, dtype=args.dtype)
    if args.mode == "wrapped":
        selfspec.wrap(model, drafter=args.drafter)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (1, args.prompt_tokens), generator=g)
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]), max_new_tokens=4, **kwargs)
        gc.collect()
        before = rss_mib()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, **kwargs)
    gc.collect()
    after = rss_mib()
    return {"mode": args.mode, "rss_before_mib": before, "peak_mib": peak_mib(), "rss_after_mib": after,
            "rss_after_trim_mib": trimmed_rss_mib()}


def trimmed_rss_mib() -> float | None:
    """RSS once glibc has returned its free heap pages (malloc_trim): what the process really still holds."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        return None
    return rss_mib()


def run_fresh(args, mode: str) -> dict:
    cmd = [sys.executable, "-m", "selfspec.tools.memory", "--mode", mode, "--model", args.model, "--dtype", args.dtype,
           "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
           "--drafter", args.drafter, "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.mode is not None:
        result = run_one(args)
        print(json.dumps(result) if args.json else result)
        return result
    results = {mode: run_fresh(args, mode) for mode in MODES}
    plain, wrapped = results["plain"], results["wrapped"]
    print(f"{args.model} {args.dtype}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new, drafter "
          f"{args.drafter}; peak RSS in MiB (each mode in a fresh process)")
    print("| mode | RSS before | peak | peak - before | RSS after | RSS after malloc_trim |")
    print("|---|---|---|---|---|---|")
    for r in results.values():
        print(f"| {r['mode']} | {r['rss_before_mib']:.0f} | {r['peak_mib']:.0f} | "
              f"{r['peak_mib'] - r['rss_before_mib']:.0f} | {r['rss_after_mib']:.0f} | {r['rss_after_trim_mib']:.0f} |")
    print(f"peak wrapped / plain: {wrapped['peak_mib'] / plain['peak_mib']:.2f}x; growth during the call: "
          f"{(wrapped['peak_mib'] - wrapped['rss_before_mib']) / max(plain['peak_mib'] - plain['rss_before_mib'], 1):.2f}x")
    return results


if __name__ == "__main__":
    main()
