"""selfspec.pack_weights: oneDNN-prepacked bfloat16 Linears on CPU give the dense call's bits, so packing changes
no output, plain or speculative; the packed kernel is really the one that runs; and it steps aside whenever its
copy could be wrong (weights changed, autograd, other dtypes)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import selfspec
from selfspec.packing import Packed, PackedForward, dense_weights, is_packed, packing_available
from selfspec.small_gemm import KERNEL_REVISION, fit, kernel_ops, many_row_sums
from tests.conftest import TEST_DEVICE, make_model, prompt

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu" or not packing_available(),
                                reason="packing is oneDNN's, for bfloat16 on CPU")


def linears(model, with_bias: bool | None = None) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear
            and (with_bias is None or (m.bias is not None) == with_bias)]


def first_packed(model) -> PackedForward:
    return next(m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), PackedForward))


def copies_of_zeros(weight: torch.Tensor) -> Packed:
    """Packed copies (oneDNN's and, where fitted, the small-row kernel's) of an all-zero weight: what a test puts in
    place of the real ones to show that the packed copies are what computes."""
    zeros = torch.zeros_like(weight)
    small = fit(zeros, lambda x: x @ zeros.T)
    return Packed(torch.ops.mkldnn._reorder_linear_weight(zeros, None), small)


@pytest.fixture(scope="module")
def smollm2_bf16():
    from selfspec.models import load_default_model

    try:
        model, tok = load_default_model(dtype=torch.bfloat16)
    except (ModuleNotFoundError, ImportError) as err:
        pytest.skip(str(err))
    yield model, tok
    selfspec.unpack_weights(model)


def test_packs_bias_free_bf16_linears_only():
    llama = make_model("llama", dtype=torch.bfloat16)
    assert selfspec.pack_weights(llama) == len(linears(llama)) == 29  # 4 layers x 7 projections + the LM head
    qwen2 = make_model("qwen2", dtype=torch.bfloat16)  # q, k, v carry biases: the fused add rounds differently
    assert selfspec.pack_weights(qwen2) == len(linears(qwen2, with_bias=False)) < len(linears(qwen2))
    assert selfspec.unpack_weights(llama) == 29 and not is_packed(llama)


def test_refuses_a_model_with_nothing_to_pack():
    with pytest.raises(ValueError, match="nothing to pack .*float32 on cpu.*dtype=torch.bfloat16"):
        selfspec.pack_weights(make_model("llama", dtype=torch.float32))


@torch.no_grad()
def test_packed_kernel_runs_and_gives_the_dense_bits():
    model = make_model("llama", dtype=torch.bfloat16)
    ids = prompt(length=12)
    want = model(ids).logits
    selfspec.pack_weights(model)
    assert torch.equal(model(ids).logits, want)
    # the packed copy is what computes: a copy of other weights changes the output, until dense_weights()
    forward = first_packed(model)
    forward.packed = copies_of_zeros(forward.module().weight)
    assert not torch.equal(model(ids).logits, want)
    with dense_weights():
        assert torch.equal(model(ids).logits, want)


def test_steps_aside_for_changed_weights_autograd_and_copies():
    model = make_model("llama", dtype=torch.bfloat16)
    selfspec.pack_weights(model)
    ids = prompt(length=6)
    layer = linears(model)[0]
    x = torch.randn(1, 3, layer.in_features).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place: the packed copy is stale, the dense weight computes
        assert torch.equal(layer(x), nn.functional.linear(x, layer.weight))
        layer.weight = nn.Parameter(layer.weight * 3)  # a new tensor: likewise
        assert torch.equal(layer(x), nn.functional.linear(x, layer.weight))
    model(ids).logits.float().sum().backward()  # training runs dense, so gradients reach the weights
    assert linears(model)[-1].weight.grad is not None
    twin = copy.deepcopy(model)  # oneDNN's opaque tensor cannot be copied: the copy computes dense
    with torch.no_grad():
        assert not is_packed(twin) and torch.equal(twin(ids).logits, model(ids).logits)


def draft_vocabulary_rows_run_packed(model) -> None:
    """A head's draft-vocabulary rows of a packed LM head are packed once asked for twice, give the dense bits,
    and are what computes (exact output alone cannot show it: verification hides any draft error)."""
    from selfspec.arch.base import _ROWS

    head, adapter = next(iter(model.selfspec.heads.values())), model.selfspec.adapter
    assert head.vocab_ids is not None
    normed = torch.randn(1, 3, adapter.lm_head.in_features).to(torch.bfloat16)
    with dense_weights():
        want = adapter.logits(normed, head.vocab_ids)
    for _ in range(2):
        assert torch.equal(adapter.logits(normed, head.vocab_ids), want)
    entry = _ROWS[id(head.vocab_ids)]
    assert entry.packed is not None
    entry.packed = copies_of_zeros(entry.sub)
    assert not torch.equal(adapter.logits(normed, head.vocab_ids), want)
    entry.packed, entry.pack_tried = None, False  # packed again at the next call


@pytest.mark.slow
@torch.no_grad()
def test_packing_changes_no_token_of_plain_or_speculative_generate(smollm2_bf16):
    """The real model in bfloat16 with the shipped heads (a draft-vocabulary head: its LM-head rows are packed
    too). Each output is compared with the same generate on the dense weights."""
    from selfspec.pretrained import shipped_dir
    from selfspec.prompts import chat_input_ids

    model, tok = smollm2_bf16
    ids = chat_input_ids(tok, "Summarise the plot of Hamlet in three sentences.")
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    plain = model.generate(ids, **kwargs)
    selfspec.wrap(model, shipped_dir("smollm2-135m"), max_draft_tokens=4)
    try:
        spec = model.generate(ids, **kwargs)
        selfspec.pack_weights(model)
        assert all(is_packed(head) for head in model.selfspec.heads.values())
        assert torch.equal(model.generate(ids, **kwargs), spec)
        assert model.selfspec.last_stats.drafted_tokens > 0
        draft_vocabulary_rows_run_packed(model)
    finally:
        selfspec.unwrap(model)
    assert torch.equal(model.generate(ids, **kwargs), plain)


@pytest.mark.slow
def test_load_packs_bf16_on_cpu_only_when_asked():
    """Packing reaches private torch ops, so it is an opt-in: the default load leaves the weights dense."""
    model, _ = selfspec.load("smollm2-135m", dtype="bfloat16", pack_weights=True)
    assert is_packed(model) and all(is_packed(head) for head in model.selfspec.heads.values())
    assert not is_packed(selfspec.load("smollm2-135m", dtype="bfloat16")[0])
    assert not is_packed(selfspec.load("smollm2-135m", dtype="bfloat16", pack_weights=False)[0])


def test_measurements_tell_packed_from_dense(monkeypatch):
    """A calibration's study identity (and so its default study name) records packing: packed steps are faster,
    so trials timed on the dense model are another setup's; and so does the small-row kernel, faster still."""
    from selfspec.attention import SWITCH
    from selfspec.tools.calibrate.study import _default_study_name
    from selfspec.tools.measure import model_identity

    monkeypatch.setenv(SWITCH, "0")  # the names' last part, folded attention, has a test of its own (test_attention)
    model = make_model("llama", dtype=torch.bfloat16)
    dense = {**model_identity(model, "tiny"), "heads": []}
    selfspec.pack_weights(model, small_gemm=False)
    packed = {**model_identity(model, "tiny"), "heads": []}
    assert (dense["packed"], packed["packed"], packed["small_gemm"]) == (False, True, False)
    assert _default_study_name(packed) == _default_study_name(dense) + "-packed"
    if kernel_ops() is not None:
        selfspec.unpack_weights(model)
        selfspec.pack_weights(model)
        small = {**model_identity(model, "tiny"), "heads": []}
        assert small["small_gemm"] == f"{KERNEL_REVISION}-{many_row_sums()}" and KERNEL_REVISION == 3
        assert _default_study_name(small) == _default_study_name(packed) + f"-smallgemm3-{many_row_sums()}"
