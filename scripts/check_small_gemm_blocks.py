"""Which K blocks give oneDNN's bits, per weight shape: the check behind small_gemm.k_block_candidates' rule.

    OMP_NUM_THREADS=1 python scripts/check_small_gemm_blocks.py --threads 1
    python scripts/check_small_gemm_blocks.py --ins 576 1536 --outs 1536 --rows 256

For each (out, in) shape of random bf16 weights, random rows go through oneDNN's packed call in 1-row calls and
in calls of 2..16 rows (small_gemm._multi_row_calls), and through the small-row kernel at every candidate block.
Prints, per shape and call kind, how many outputs differ at each block, and whether the rule's block is the one
that gives every bit. Needs a CPU with AVX512-BF16 and a compiler for the kernel.
"""
from __future__ import annotations

import argparse

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ins", type=int, nargs="+", default=[192, 576, 768, 1024, 1152, 1536, 2048, 3072, 4096, 5632])
    p.add_argument("--outs", type=int, nargs="+", default=[576, 1536])
    p.add_argument("--rows", type=int, default=200, help="random rows per call kind")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def differing(ops, packed, x, want, block) -> int:
    from selfspec.small_gemm import many_row_sums  # the same bits either way; the sums this CPU runs

    return int((ops.linear(x, packed, block, many_row_sums() == "fma") != want).sum())


@torch.no_grad()
def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from selfspec.packing import _onednn_linear
    from selfspec.small_gemm import _multi_row_calls, k_block_candidates, kernel_ops

    ops = kernel_ops()
    if ops is None:
        raise SystemExit("the small-row kernel is unavailable here (no AVX512-BF16, no compiler, or switched off)")
    generator = torch.Generator().manual_seed(0)
    holds = total = 0
    print("| out x in | calls | differing outputs per block | rule's block | gives every bit |")
    print("|---|---|---|---|---|")
    for k in args.ins:
        for n in args.outs:
            weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
            onednn, packed = torch.ops.mkldnn._reorder_linear_weight(weight, None), ops.packed_weight(weight)
            for kind, sizes in (("1 row", [1] * args.rows), ("2-16 rows", _multi_row_calls(args.rows))):
                x = torch.randn(1, sum(sizes), k, generator=generator).to(torch.bfloat16)
                want = torch.cat([_onednn_linear(part.contiguous(), onednn) for part in x.split(sizes, dim=1)], 1)
                blocks = sorted({b for b in (64, 128, 256, 384, 512, 768, 1024, k) if b <= k})
                counts = {b: differing(ops, packed, x, want, b) for b in blocks}
                rule = k_block_candidates(k, sizes[0])[0]
                holds, total = holds + (counts[rule] == 0), total + 1
                cells = ", ".join(f"{b}: {c}" for b, c in counts.items())
                print(f"| {n} x {k} | {kind} | {cells} | {rule} | {'yes' if counts[rule] == 0 else 'NO'} |")
    print(f"\nthe rule gives every bit for {holds} of {total} (shape, call kind)")


if __name__ == "__main__":
    main()
