"""A bfloat16 matmul for the few rows of a decoding step or a verify pass, with oneDNN's bits, on AVX512-BF16 CPUs.

    from selfspec.small_gemm import fit, small_linear
    small = fit(weight, onednn_call)        # None where the kernel is unavailable or its bits would differ
    y = small_linear(x, small)              # x (..., in) bf16 with at most SMALL_ROWS rows -> (..., out)

Why: on one core of an Intel Xeon with AVX512-BF16, oneDNN's prepacked call takes 134 us for one row of SmolLM2's
576 -> 1536 projection, about what it takes for three; this kernel streams the weight once through vdpbf16ps with
every row's sums in registers and takes 51 us for one row. A whole 1-token step of the
model falls from 79.5 to 58.1 ms (python -m selfspec.tools.pass_cost). From two rows on the kernel sums either with
vdpbf16ps or with float32 FMAs over the widened weight, whichever a probe finds faster on the CPU (many_row_sums),
and prefetches the weight, so that a verify pass's rows hide under the weight's arrival. On the Xeon FMAs won:
SmolLM2's matmuls over 5 rows cost 1.09x their 1-row time, 9 rows 1.27x, and a whole 5-token pass 1.21x a 1-token
one against 1.44x with vdpbf16ps alone. On an AMD EPYC (Zen 5) vdpbf16ps wins:
5 rows 1.16x, 9 rows 1.31x, against 1.34x and 1.62x with FMAs.

Bits: the kernel (csrc/small_gemm.cpp) sums each output in float32 in the order oneDNN uses there (K in blocks
of `k_block`, each block from zero, the block sums added in order) and rounds once. oneDNN's blocks differ
between 1-row calls and wider ones once K passes 1024, so a weight carries one block for each. `fit` checks the
blocks on random rows against the oneDNN call the kernel would replace, and refuses the weight on a single
differing bit, so using the kernel changes no output; on a CPU whose oneDNN sums in another order (AMX, another
release) nothing is replaced.

The kernel is compiled on first use with torch's C++ extension loader (gcc or clang and ninja), then cached under
~/.cache/torch_extensions. Where compiling fails packing keeps oneDNN's call for every size, with one warning
saying why; SELFSPEC_SMALL_GEMM=0 does the same silently.
"""
from __future__ import annotations

import functools
import os
import pathlib
import statistics
import time
import warnings
from dataclasses import dataclass

import torch

SMALL_ROWS = 16  # calls with at most this many rows use the kernel; a prompt's prefill stays with oneDNN
# the kernel's timing revision, in study identities (timings of one revision are not another's): 1 was
# vdpbf16ps at every row count; 2 summed rows 2-16 with float32 FMAs and prefetched the weight; 3 sums rows 2-16
# with whichever of the two is faster on the CPU (many_row_sums), the weight prefetched either way
KERNEL_REVISION = 3
SUMS = ("dot", "fma")  # vdpbf16ps, or float32 FMAs over the widened weight: the two sums of calls of 2+ rows
PROBE_SUMS_ROUNDS = 7  # interleaved timing rounds of many_row_sums's probe, median kept
PROBE_ROWS = 1024  # most random rows `fit` compares per call kind, fewer for wide weights (PROBE_OUTPUTS)
# outputs compared per call kind: a near-right block (all of K = 576 where oneDNN sums 512 + 64) differs in only
# 1-2 outputs of 115k, so half a million are compared
PROBE_OUTPUTS = 1 << 19
_SOURCE = pathlib.Path(__file__).parent / "csrc" / "small_gemm.cpp"
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]


@dataclass
class SmallWeight:
    """A weight in the kernel's layout, with the K blocks its sums must use to give oneDNN's bits: oneDNN sums a
    1-row call in other blocks than a call of more rows once K passes 1024."""

    packed: torch.Tensor  # (out / 16, in / 2, 16, 2) bf16
    k_block_one: int  # for 1-row calls
    k_block_many: int  # for calls of 2..SMALL_ROWS rows
    widened_fma: bool  # calls of 2+ rows sum with float32 FMAs rather than vdpbf16ps (many_row_sums)

    def k_block(self, rows: int) -> int:
        return self.k_block_one if rows == 1 else self.k_block_many


def cpu_has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no way to ask here, so no kernel
        return False


@functools.lru_cache(maxsize=None)
def kernel_ops():
    """torch.ops.selfspec_small_gemm, compiled and loaded once per process, or None when it cannot be (warned once
    where compiling failed; switched off, or a CPU without the instruction, is no news)."""
    if os.environ.get("SELFSPEC_SMALL_GEMM", "1") == "0" or not cpu_has_avx512_bf16():
        return None
    try:
        from torch.utils.cpp_extension import load

        load("selfspec_small_gemm", [str(_SOURCE)], extra_cflags=_FLAGS, is_python_module=False, verbose=False)
        return torch.ops.selfspec_small_gemm
    except Exception as err:  # a missing compiler or ninja shows up here, in many shapes
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:200]}"
        warnings.warn(f"selfspec's small-row bf16 kernel is off: compiling it failed ({reason}); packed weights keep "
                      f"oneDNN's call for every size (same outputs, slower steps). Install gcc and ninja to enable "
                      f"it, or set SELFSPEC_SMALL_GEMM=0 to silence this.", stacklevel=3)
        return None


@functools.lru_cache(maxsize=None)
def many_row_sums() -> str:
    """How the kernel sums calls of 2..SMALL_ROWS rows in this process, one of SUMS: SELFSPEC_SMALL_GEMM_SUMS where
    set, else whichever a short probe times faster here. The bits are the same either way; the speed is not, and
    differs by CPU: on one core of an Intel Xeon vdpbf16ps retires 36 G multiply-adds a second and float32 FMAs
    81 G, on an AMD EPYC (Zen 5) 208 G against 105 G."""
    chosen = os.environ.get("SELFSPEC_SMALL_GEMM_SUMS")
    if chosen is not None:
        if chosen not in SUMS:
            raise ValueError(f"SELFSPEC_SMALL_GEMM_SUMS={chosen!r} is not one of {SUMS}; unset it to let selfspec "
                             f"time both.")
        return chosen
    ops = kernel_ops()
    return "dot" if ops is None else _faster_sums(ops)


@torch.no_grad()
def _faster_sums(ops) -> str:
    """Times both sums over eight SmolLM2-sized weights (14 MB, past L2 as a model's weights are) at 5 and 9 rows,
    rounds interleaved; about 20 ms."""
    generator = torch.Generator().manual_seed(0)
    weights = [ops.packed_weight(torch.randn(shape, generator=generator).to(torch.bfloat16))
               for shape in [(1536, 576), (576, 1536)] * 4]
    calls = [(torch.randn(m, w.shape[1] * 2, generator=generator).to(torch.bfloat16), w)
             for m in (5, 9) for w in weights]  # (rows, weight)
    times = {sums: [] for sums in SUMS}
    for _ in range(PROBE_SUMS_ROUNDS + 1):  # the first round warms up
        for sums in SUMS:
            start = time.perf_counter()
            for x, w in calls:
                ops.linear(x, w, min(x.shape[1], 512), sums == "fma")
            times[sums].append(time.perf_counter() - start)
    return min(SUMS, key=lambda sums: statistics.median(times[sums][1:]))


def k_block_candidates(k: int, rows: int) -> list[int]:
    """K blocks to try, the one oneDNN was seen to use first (bit for bit, 20 shapes, K 192..5632, on an
    AVX512-BF16 Xeon): all of K up to 512; past it 512 for a 1-row call, and for more rows 512 up to K = 1024 and
    1024 beyond."""
    seen = k if k <= 512 else 512 if rows == 1 or k <= 1024 else 1024
    return [b for b in dict.fromkeys([seen, k, 512, 1024]) if b <= k]


def supported(weight: torch.Tensor) -> bool:
    out, inp = weight.shape
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and out % 32 == 0 and inp % 2 == 0


@torch.no_grad()
def fit(weight: torch.Tensor, reference) -> SmallWeight | None:
    """The weight in the kernel's layout, with the K blocks whose sums give `reference`'s bits (x -> x @ weight.T,
    the oneDNN call being replaced); None when the kernel is unavailable, the shape unsupported, or no block gives
    every bit. The blocks are found once per shape and process (`_blocks_for`: the order is the kernel's for that
    shape, whatever the values); each weight then gets a short check of its own, a 1-row and a 5-row call."""
    shape = tuple(weight.shape)
    ops = kernel_ops() if supported(weight) else None
    if ops is None or (shape in _BLOCKS and _BLOCKS[shape] is None):  # a shape refused once is refused again
        return None
    packed = ops.packed_weight(weight.detach())
    if shape not in _BLOCKS:
        _BLOCKS[shape] = _blocks_for(ops, packed, reference, shape[1])
    if _BLOCKS[shape] is None:
        return None
    small = SmallWeight(packed, *_BLOCKS[shape], widened_fma=many_row_sums() == "fma")
    x = torch.randn(1, 6, shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for part in (x[:, :1], x[:, 1:]):
        if not torch.equal(small_linear(part.contiguous(), small), reference(part.contiguous())):
            return None
    return small


# (out, in) -> (k_block_one, k_block_many), or None where no block gives oneDNN's bits; filled by fit
_BLOCKS: dict[tuple[int, int], tuple[int, int] | None] = {}


def _blocks_for(ops, packed: torch.Tensor, reference, k: int) -> tuple[int, int] | None:
    """The K blocks giving `reference`'s bits on random rows in 1-row calls and as many in calls of 2 to SMALL_ROWS
    rows (PROBE_OUTPUTS outputs each, within 16..PROBE_ROWS rows), or None."""
    generator = torch.Generator().manual_seed(0)
    outputs_per_row = packed.shape[0] * 16
    rows = min(PROBE_ROWS, max(SMALL_ROWS, PROBE_OUTPUTS // outputs_per_row))
    blocks, fma = [], many_row_sums() == "fma"
    for sizes in ([1] * rows, _multi_row_calls(rows)):
        x = torch.randn(1, sum(sizes), k, generator=generator).to(torch.bfloat16)
        want = torch.cat([reference(part.contiguous()) for part in x.split(sizes, dim=1)], 1)
        found = [b for b in k_block_candidates(k, sizes[0]) if torch.equal(ops.linear(x, packed, b, fma), want)]
        if not found:
            return None
        blocks.append(found[0])
    return blocks[0], blocks[1]


def _multi_row_calls(rows: int) -> list[int]:
    """Call sizes from 2 to SMALL_ROWS that add up to `rows`: the sizes of drafts, verify passes, trees."""
    sizes, size = [], 2
    while sum(sizes) < rows:
        sizes.append(min(size, rows - sum(sizes), SMALL_ROWS))
        size = size + 1 if size < SMALL_ROWS else 2
    if sizes[-1] == 1:  # a 1-row remainder would be judged by the other rule
        sizes[-2:] = [sizes[-2] + 1]
    return sizes


def small_linear(x: torch.Tensor, small: SmallWeight) -> torch.Tensor:
    """(..., in) bf16 CPU rows -> (..., out) through the kernel."""
    rows = x.numel() // x.shape[-1]
    return torch.ops.selfspec_small_gemm.linear(x, small.packed, small.k_block(rows), small.widened_fma)
