"""What folding grouped-query attention into query rows (selfspec/attention.py) saves, per sdpa call and per pass.

    OMP_NUM_THREADS=1 python scripts/measure_attention.py --threads 1
    OMP_NUM_THREADS=1 python scripts/measure_attention.py --threads 1 --cache 150 600 1200 --tokens 1 2 4 9

Two tables, both bf16 on this CPU. First one sdpa call of SmolLM2's shape (9 query heads over 3 KV heads, head
size 64) on a cache of L tokens held in a larger preallocated buffer as the engine's cache holds it: torch's call
with grouped heads in place (what transformers runs, with TRANSFORMERS_SDPA_FORCE_GQA=1 where a mask is given)
against the folded call. Then whole passes of T tokens through all 30 layers of the embedded SmolLM2 with the
engine's own split forward on a cache of L tokens, attention folded or not (SELFSPEC_FOLDED_GQA). Timings of both
kinds are interleaved repeat by repeat; medians.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
from torch.nn import functional as F


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", nargs="+", type=int, default=[150, 600, 1200], help="tokens already cached (L)")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 9], help="query tokens per call or pass (T)")
    p.add_argument("--repeats", type=int, default=15, help="interleaved repeats; the median is kept")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def call_table(args) -> None:
    from selfspec.attention import fold_rows

    print("one sdpa call, bf16, 9 query heads over 3 KV heads of 64 (median us)")
    print(f"  {'L':>5s} {'T':>3s} {'in place':>9s} {'folded':>8s} {'ratio':>6s}")
    for length in args.cache:
        keys = torch.randn(1, 3, 2 * length + 64, 64, dtype=torch.bfloat16)[:, :, :length]
        values = torch.randn(1, 3, 2 * length + 64, 64, dtype=torch.bfloat16)[:, :, :length]
        for t in args.tokens:
            query = torch.randn(1, t, 9, 64, dtype=torch.bfloat16).transpose(1, 2)  # as the projection gives it
            mask = None if t == 1 else torch.ones(1, 1, t, length, dtype=torch.bool).tril(length - t)

            def in_place():
                F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)

            def folded():
                rows, folded_mask = fold_rows(query, mask, 3)
                F.scaled_dot_product_attention(rows, keys, values, attn_mask=folded_mask)

            times = {"in place": [], "folded": []}
            for _ in range(args.repeats):
                for name, fn in (("in place", in_place), ("folded", folded)):
                    times[name].append(min(seconds(fn) for _ in range(20)))
            a, b = (1e6 * statistics.median(times[k]) for k in ("in place", "folded"))
            print(f"  {length:5d} {t:3d} {a:9.0f} {b:8.0f} {a / b:6.2f}")


@contextlib.contextmanager
def folding(on: bool):
    before = os.environ.get("SELFSPEC_FOLDED_GQA")
    os.environ["SELFSPEC_FOLDED_GQA"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["SELFSPEC_FOLDED_GQA"]
        else:
            os.environ["SELFSPEC_FOLDED_GQA"] = before


@torch.no_grad()
def pass_table(args) -> None:
    import selfspec
    from selfspec.forward import forward_early
    from selfspec.tools.cost_model import _prefilled_context

    model, _ = selfspec.load("smollm2-135m")
    adapter = model.selfspec.adapter
    print(f"\nwhole passes through all {adapter.num_layers} layers, {model.dtype} (median ms)")
    print(f"  {'L':>5s} {'T':>3s} {'in place':>9s} {'folded':>8s} {'ratio':>6s}")
    for length in args.cache:
        prompt = torch.randint(100, 20000, (1, length))
        ctx = _prefilled_context(adapter, prompt)
        for t in args.tokens:
            ids = torch.randint(100, 20000, (1, t))
            positions = length + torch.arange(t)[None, :]

            def run():
                forward_early(ctx, ids, positions, adapter.num_layers)
                ctx.cache.rollback(length)

            times = {True: [], False: []}
            for _ in range(args.repeats):
                for on in (False, True):
                    with folding(on):
                        times[on].append(seconds(run))
            a, b = (1e3 * statistics.median(times[k]) for k in (False, True))
            print(f"  {length:5d} {t:3d} {a:9.1f} {b:8.1f} {a / b:6.2f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    call_table(args)
    pass_table(args)


if __name__ == "__main__":
    main()
