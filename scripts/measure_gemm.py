"""Throughput of one linear layer's matmul against the number of tokens M, per dtype: why a verify pass over M
tokens costs what it does on this CPU.

    OMP_NUM_THREADS=1 python scripts/measure_gemm.py --threads 1
    python scripts/measure_gemm.py --shape 576 1536 --tokens 1 15 64 256 --dtypes bfloat16 float32
    python scripts/measure_gemm.py --dtypes bfloat16 bfloat16-packed    # prepacked weight (pack_weights)
    python scripts/measure_gemm.py --dtypes bfloat16-onednn bfloat16-packed   # without and with the small-row kernel

A decoding step reads every weight once: at M=1 a matmul is bound by memory, and a pass over M tokens costs
about the same while the extra multiply-adds fit in the time the weights take to arrive. Once they do not, the
pass grows with M, at the rate the CPU computes in that dtype. The table gives GFLOP/s (2 * M * in * out per
call) for SmolLM2-135M's MLP shape by default, the weight reused across calls (so held in cache: the compute
side of the trade); scripts/measure_pass_cost.py times whole passes. bfloat16-packed calls the weight prepacked
in oneDNN's layout once (selfspec.pack_weights), where a plain bf16 call reorders it every time.
"""
from __future__ import annotations

import argparse
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", nargs=2, type=int, default=[576, 1536], metavar=("IN", "OUT"),
                   help="the linear layer's input and output features (default: SmolLM2-135M's MLP up-projection)")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 3, 9, 15, 64, 256], help="rows M of the input")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=50, help="timed calls per (dtype, M); the fastest of 3 rounds")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def seconds_per_call(x: torch.Tensor, linear, repeats: int) -> float:
    """Fastest of three rounds of `repeats` calls of linear(x), in seconds per call."""
    for _ in range(5):  # warm-up: kernel choice and first allocations
        linear(x)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            linear(x)
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def linear_of(name: str, weight: torch.Tensor):
    """x -> x @ weight.T, the plain call, or the call on its packed copies: -packed as pack_weights makes them (the
    small-row kernel for a few rows where it fits, oneDNN's call otherwise), -onednn oneDNN's alone."""
    if not name.endswith(("-packed", "-onednn")):
        return lambda x: torch.nn.functional.linear(x, weight)
    from selfspec.packing import pack_matrix, packed_linear

    packed = pack_matrix(weight, small=name.endswith("-packed"))
    return lambda x: packed_linear(x, weight, packed)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    n_in, n_out = args.shape
    print(f"linear {n_in} -> {n_out}, {torch.get_num_threads()} thread(s); per call: microseconds, GFLOP/s")
    print("| dtype | " + " | ".join(f"M={m}" for m in args.tokens) + " |")
    print("|---" * (len(args.tokens) + 1) + "|")
    with torch.no_grad():
        for name in args.dtypes:
            dtype = getattr(torch, name.removesuffix("-packed").removesuffix("-onednn"))
            weight = torch.randn(n_out, n_in).to(dtype)
            linear = linear_of(name, weight)
            cells = []
            for m in args.tokens:
                s = seconds_per_call(torch.randn(m, n_in).to(dtype), linear, args.repeats)
                cells.append(f"{s * 1e6:.0f} us, {2 * m * n_in * n_out / s / 1e9:.0f}")
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
