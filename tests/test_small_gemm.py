"""The small-row bf16 kernel (selfspec/small_gemm.py): its sums are the documented ones, `fit` hands out only weights
whose every bit matches the oneDNN call it replaces at each row count, and packed Linears route calls of a few rows
to it and larger calls to oneDNN."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import selfspec
from selfspec.packing import PackedForward, _onednn_linear, onednn_weights, packs_small
from selfspec.small_gemm import (SMALL_ROWS, SUMS, SmallWeight, cpu_has_avx512_bf16, fit, kernel_ops, many_row_sums,
                                 small_linear)
from tests.conftest import TEST_DEVICE, make_model, prompt

# where the CPU has the instruction the kernel must build: a compile error fails here instead of skipping
pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu" or not cpu_has_avx512_bf16(),
                                reason="the small-row kernel is for CPUs with AVX512-BF16")


def test_the_kernel_builds_on_this_cpu():
    assert kernel_ops() is not None


def random_bf16(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def onednn_reference(weight):
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return lambda x: _onednn_linear(x.contiguous(), packed)


def documented_sums(x: torch.Tensor, weight: torch.Tensor, k_block: int) -> torch.Tensor:
    """(M, K) x (N, K) -> (M, N) as the kernel's header states it, in float32 step by step: K in blocks of k_block,
    each summed from zero pair by pair (k + 1 before k), the block sums added in order, rounded once."""
    xs, ws = x.float(), weight.float()
    total = None
    for start in range(0, x.shape[1], k_block):
        acc = torch.zeros(x.shape[0], weight.shape[0])
        for k in range(start, min(start + k_block, x.shape[1]), 2):
            acc = (acc + xs[:, k + 1, None] * ws[None, :, k + 1]) + xs[:, k, None] * ws[None, :, k]
        total = acc if total is None else total + acc
    return total.to(torch.bfloat16)


@torch.no_grad()
@pytest.mark.parametrize("sums", SUMS)
@pytest.mark.parametrize("k_block", [64, 96, 160])
def test_kernel_sums_in_the_documented_order(k_block, sums):
    weight, x = random_bf16(2048, 160), random_bf16(64, 160, seed=1)  # 131k outputs: order shows in a few dozen
    small = SmallWeight(kernel_ops().packed_weight(weight), k_block, k_block, widened_fma=sums == "fma")
    assert torch.equal(small_linear(x, small), documented_sums(x, weight, k_block))


@torch.no_grad()
@pytest.mark.parametrize("sums", SUMS)
def test_one_row_and_many_row_paths_agree_on_denormals(sums):
    """One row runs through vdpbf16ps, several through vdpbf16ps or float32 FMAs; for one K block every row must
    get the same bits either way, also where products and sums fall below float32's normal range (vdpbf16ps
    flushes them; the FMA path matches only under DAZ and FTZ)."""
    weight, x = random_bf16(256, 128) * 2.0 ** -64, random_bf16(12, 128, seed=2) * 2.0 ** -64  # products near 2**-128
    small = SmallWeight(kernel_ops().packed_weight(weight), 128, 128, widened_fma=sums == "fma")
    one_by_one = torch.cat([small_linear(row[None], small) for row in x])
    assert (one_by_one != 0).float().mean() > 0.1  # not all flushed: the sums' own bits are compared
    assert torch.equal(small_linear(x, small), one_by_one)


def fitted(weight: torch.Tensor, reference) -> SmallWeight:
    """fit's kernel for `weight`. On a CPU whose oneDNN runs bf16 on AMX tiles (`brg_matmul:..._amx`), which sum in
    another order than the kernel can, fit must refuse every weight, and the test skips; on any other AVX512-BF16
    CPU a refusal fails."""
    small = fit(weight, reference)
    if small is None and torch.cpu.get_capabilities().get("amx_bf16"):
        pytest.skip("oneDNN sums bf16 on AMX tiles here, in another order than the kernel's: fit refuses, as it must")
    assert small is not None
    return small


@torch.no_grad()
@pytest.mark.parametrize("sums", SUMS)
@pytest.mark.parametrize("shape", [(64, 192), (1536, 576), (576, 1536)])  # K of one block, of 512s, 512s/1024s
def test_fitted_kernel_gives_onednns_bits_at_every_row_count(shape, sums):
    """With the blocks fit found, either sums of many rows (whichever this CPU's probe chose) gives oneDNN's bits."""
    weight = random_bf16(*shape)
    reference = onednn_reference(weight)
    small = dataclasses.replace(fitted(weight, reference), widened_fma=sums == "fma")
    for rows in range(1, SMALL_ROWS + 1):
        x = random_bf16(1, rows * 8, shape[1], seed=rows)  # 8 calls of each size on fresh rows
        for part in x.split(rows, dim=1):
            assert torch.equal(small_linear(part, small), reference(part)), rows


@torch.no_grad()
def test_a_wrong_block_differs_and_fit_refuses_other_sums():
    """The negative controls: with K = 1536 the rule's blocks matter (the 1-row rule applied to wider calls, or
    one block for all of K, changes bits); and a reference that rounds the exact sum instead is refused."""
    weight = random_bf16(576, 1536)
    assert fit(weight, lambda x: (x.double() @ weight.double().T).to(torch.bfloat16)) is None
    assert fit(random_bf16(48, 64), onednn_reference(random_bf16(48, 64))) is None  # out % 32 != 0: unsupported
    reference = onednn_reference(weight)
    small = fitted(weight, reference)
    assert (small.k_block_one, small.k_block_many) == (512, 1024)
    x = random_bf16(1, 256, 1536, seed=3)
    want = torch.cat([reference(part) for part in x.split(16, dim=1)], 1)
    for wrong in (512, 1536):
        assert not torch.equal(kernel_ops().linear(x, small.packed, wrong, small.widened_fma), want)


@torch.no_grad()
def test_packed_linears_route_small_calls_to_the_kernel_and_prefills_to_onednn():
    model = make_model("llama", dtype=torch.bfloat16)
    ids = prompt(length=SMALL_ROWS + 4)
    want = model(ids).logits
    selfspec.pack_weights(model)
    assert packs_small(model) and torch.equal(model(ids).logits, want)
    forwards = [m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), PackedForward)
                and m.forward.packed.small is not None]
    for forward in forwards:  # the kernel's copies of zeros: calls it takes now give other logits
        zeros = torch.zeros_like(forward.module().weight)
        forward.packed.small = SmallWeight(kernel_ops().packed_weight(zeros), 64, 64, widened_fma=False)
    assert torch.equal(model(ids).logits, want)  # a 20-token call: oneDNN's copy
    assert not torch.equal(model(ids[:, :SMALL_ROWS]).logits, want[:, :SMALL_ROWS])
    with onednn_weights():  # the bench's hf-greedy-onednn: oneDNN's call at every size
        assert torch.equal(model(ids[:, :SMALL_ROWS]).logits, want[:, :SMALL_ROWS])


def test_switched_off_by_the_environment():
    code = ("import torch, selfspec; from selfspec.packing import packs_small, is_packed; "
            "from tests.conftest import make_model; m = make_model('llama', dtype=torch.bfloat16); "
            "selfspec.pack_weights(m); print(is_packed(m), packs_small(m))")
    env = {**os.environ, "SELFSPEC_SMALL_GEMM": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"] and "small-row" not in out.stderr


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          cwd=os.getcwd())


def test_many_row_sums_are_timed_or_set_by_the_environment():
    assert many_row_sums() in SUMS  # this process's probe
    code = "from selfspec.small_gemm import many_row_sums; print(many_row_sums())"
    for sums in SUMS:
        out = run_python(code, SELFSPEC_SMALL_GEMM_SUMS=sums)
        assert out.returncode == 0 and out.stdout.split() == [sums], out.stderr
    out = run_python(code, SELFSPEC_SMALL_GEMM_SUMS="amx")
    assert out.returncode != 0 and "SELFSPEC_SMALL_GEMM_SUMS='amx' is not one of ('dot', 'fma')" in out.stderr
