"""The matmuls of one decoding step or verify pass, alone: every weight of the model read once per pass, as in a
real step, so from DRAM rather than from cache (scripts/measure_gemm.py reuses one weight, which stays cached).

    OMP_NUM_THREADS=1 python scripts/measure_step_gemms.py --threads 1
    python scripts/measure_step_gemms.py --tokens 1 3 5 9 15 --repeats 9

Runs the small-row kernel (selfspec/small_gemm.py) over random weights of the model's shapes: per decoder layer
q, k, v, o, gate, up, down, then the LM head, M rows each, with each of the kernel's sums of many rows (--sums:
vdpbf16ps, float32 FMAs). Passes of every M and sums are interleaved repeat by repeat; the table gives each
median pass and its ratio to the 1-row pass. Where the ratio stays near 1 the extra
rows' multiply-adds hide under the weight's arrival, which is what lets a verify pass cost about one step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="short name or local HF directory (only its config's shapes are used)")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 3, 5, 9, 15], help="rows M per matmul")
    p.add_argument("--repeats", type=int, default=7, help="interleaved passes per M; median reported")
    p.add_argument("--sums", nargs="+", default=["dot", "fma"], choices=["dot", "fma"],
                   help="the kernel's sums of 2+ rows to compare (1-row calls are vdpbf16ps either way)")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def step_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of every matmul of a Llama-style step: 7 per layer, then the LM head."""
    h, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    layer = [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter)]
    return layer * config.num_hidden_layers + [(config.vocab_size, h)]


def k_block(k: int) -> int:  # the timing does not depend on which block; one that is valid for every K
    return min(k, 512)


def median_pass_seconds(ops, shapes, runs, repeats) -> dict[tuple[str, int], float]:
    """(sums, M) -> median seconds of one pass of every matmul in `shapes` over M rows with those sums, the runs
    interleaved."""
    weights = [ops.packed_weight(torch.randn(o, i).to(torch.bfloat16)) for o, i in shapes]
    rows = {(m, k): torch.randn(m, k).to(torch.bfloat16) for _, m in runs for k in {i for _, i in shapes}}
    times = {run: [] for run in runs}
    for _ in range(repeats + 1):  # the first round warms up
        for sums, m in runs:
            start = time.perf_counter()
            for w in weights:
                k = w.shape[1] * 2
                ops.linear(rows[m, k], w, k_block(k), sums == "fma")
            times[sums, m].append(time.perf_counter() - start)
    return {run: statistics.median(t[1:]) for run, t in times.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    from selfspec.models import resolve_model
    from selfspec.small_gemm import kernel_ops

    if kernel_ops() is None:
        raise SystemExit("the small-row kernel is unavailable here (needs AVX512-BF16 and a compiler)")
    shapes = step_shapes(resolve_model(args.model, dtype="bfloat16")[0].config)
    runs = [(sums, m) for sums in args.sums for m in args.tokens]
    median = median_pass_seconds(kernel_ops(), shapes, runs, args.repeats)
    print(f"{args.model}: {len(shapes)} matmuls a pass, {sum(o * i for o, i in shapes) * 2 / 1e6:.0f} MB of bf16 "
          f"weights, {torch.get_num_threads()} thread(s), median of {args.repeats}; ratios to sums' 1-row pass")
    print("| sums \\ M | " + " | ".join(str(m) for m in args.tokens) + " |")
    print("|---" * (len(args.tokens) + 1) + "|")
    for sums in args.sums:
        unit = median[sums, min(args.tokens)]
        print(f"| {sums} | " + " | ".join(f"{median[sums, m] * 1e3:.1f} ms ({median[sums, m] / unit:.2f}x)"
                                          for m in args.tokens) + " |")

if __name__ == "__main__":
    main()
