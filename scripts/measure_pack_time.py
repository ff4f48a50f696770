"""How long selfspec.pack_weights takes on the embedded SmolLM2 in bfloat16, with and without the small-row kernel.

    OMP_NUM_THREADS=1 python scripts/measure_pack_time.py --threads 1

Two rounds each, alternating. The kernel's K blocks are found once per weight shape and process
(small_gemm._BLOCKS); they are cleared before each packing with the kernel, so every round pays what a fresh
process pays. The kernel is compiled (or loaded from torch's cache) before timing.
"""
from __future__ import annotations

import argparse
import time

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import selfspec
    from selfspec import small_gemm
    from selfspec.models import resolve_model

    small_gemm.kernel_ops()
    model, _ = resolve_model("smollm2-135m", dtype="bfloat16")
    for small in (False, True, False, True):
        small_gemm._BLOCKS.clear()
        start = time.perf_counter()
        selfspec.pack_weights(model, small_gemm=small)
        print(f"pack_weights(small_gemm={small}): {time.perf_counter() - start:.2f} s")
        selfspec.unpack_weights(model)


if __name__ == "__main__":
    main()
