"""How close can a float32 call of a few rows come to a 1-row call on an AVX2-only CPU? An experiment for the
next step, not part of the package: MKL's float32 matmul (what torch runs) against a plain AVX2 + FMA kernel
(scripts/avx2_rows.cpp, compiled here with torch's cpp_extension), over SmolLM2-135M's MLP shapes.

    OMP_NUM_THREADS=1 python scripts/measure_avx2_rows.py --threads 1

Twelve weights (21 MB, past the caches, as a model's weights are when a step reads them) are called in turn, the
two kernels interleaved round by round so that load drifting on a shared machine hits both alike; the table shows
the median microseconds per call and each row count's time over the same kernel's 1-row call. The kernel's
outputs are checked against torch's to float32 rounding first (its sums run in another order, so the bits differ),
and each kernel is asked whether a row's result depends on the other rows of its call: the kernel sums every row
in the same order whatever their number, so a verify pass would give a decoding step's bits.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import torch
from torch.utils.cpp_extension import load

ROUNDS = 9  # interleaved timing rounds, the first a warm-up


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 3, 5, 9, 16], help="rows M of the input")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def weights_past_cache(generator) -> list[torch.Tensor]:
    return [torch.randn(shape, generator=generator) / 24 for shape in [(1536, 576), (576, 1536)] * 6]


def median_call_us(call, inputs, weights) -> float:
    """Median over ROUNDS - 1 rounds of the mean time per call, every weight called once a round."""
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for w in range(len(weights)):
            call(inputs[w % 2], weights[w])
        times.append((time.perf_counter() - start) / len(weights) * 1e6)
    return statistics.median(times[1:])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ext = load("selfspec_avx2_rows", [str(pathlib.Path(__file__).with_name("avx2_rows.cpp"))],
               extra_cflags=["-O3", "-mavx2", "-mfma"], verbose=False)
    generator = torch.Generator().manual_seed(0)
    dense = weights_past_cache(generator)
    packed = [ext.pack_rows8(w) for w in dense]
    kernels = {"MKL (torch)": (torch.nn.functional.linear, dense), "AVX2 kernel": (ext.linear_rows, packed)}
    table = {name: {} for name in kernels}
    with torch.no_grad():
        for m in args.tokens:
            inputs = [torch.randn(m, 576, generator=generator), torch.randn(m, 1536, generator=generator)]
            torch.testing.assert_close(ext.linear_rows(inputs[0], packed[0]),
                                       torch.nn.functional.linear(inputs[0], dense[0]), rtol=1e-4, atol=1e-4)
            for name, (call, weights) in kernels.items():
                table[name][m] = []
            for _ in range(3):  # the two kernels alternate, three times each
                for name, (call, weights) in kernels.items():
                    table[name][m].append(median_call_us(call, inputs, weights))
        rows = torch.randn(9, 576, generator=generator)  # does a row's result depend on the call's other rows?
        same = {name: all(torch.equal(call(rows, weights[0])[r:r + 1], call(rows[r:r + 1], weights[0]))
                          for r in range(9)) for name, (call, weights) in kernels.items()}
    print("each row of a 9-row call has the bits of the same row called alone: "
          + ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in same.items()))
    print(f"float32 linear, SmolLM2-135M MLP shapes, 12 weights in turn, {torch.get_num_threads()} thread(s); "
          f"median us per call (x its own 1-row call)")
    print("| kernel | " + " | ".join(f"M={m}" for m in args.tokens) + " |")
    print("|---" * (len(args.tokens) + 1) + "|")
    for name, by_m in table.items():
        one = statistics.median(by_m[args.tokens[0]])
        cells = [f"{statistics.median(v):.0f} ({statistics.median(v) / one:.2f}x)" for v in by_m.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
