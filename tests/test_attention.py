"""Grouped-query attention folded into query rows (selfspec/attention.py): the same attention, only inside the engine,
only where it is meant to run."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import selfspec
from conftest import TEST_DEVICE, greedy_with_scores, make_model, prompt
from selfspec import attention
from selfspec.attention import ENGINE_ATTENTION, SWITCH, fold_rows

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the fold runs on CPU only")


def _attention64(query, key, value, mask, groups: int) -> torch.Tensor:
    """Reference: float64 softmax attention with the KV heads repeated, mask (B, 1, T, L) boolean."""
    q, k, v = (x.double() for x in (query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def _case(seed: int, batch: int, t: int, length: int, heads: int = 9, kv_heads: int = 3):
    g = torch.Generator().manual_seed(seed)
    # queries as the projection gives them (a transposed view), keys and values inside a longer cache buffer
    query = torch.randn(batch, t, heads, 64, generator=g).to(torch.bfloat16).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, length + 17, 64, generator=g).to(torch.bfloat16)[:, :, :length]
                  for _ in range(2))
    mask = None
    if t > 1 or batch > 1:  # causal over the new tokens, and holes where a left-padded row has none
        mask = torch.ones(batch, 1, t, length, dtype=torch.bool).tril(length - t)
        mask[1:, :, :, : length // 3] = False
    return query, key, value, mask


@pytest.mark.parametrize("batch,t,length", [(1, 1, 40), (1, 1, 700), (1, 3, 300), (2, 5, 129), (2, 9, 520),
                                            (1, 10, 1100)])
def test_the_folded_call_is_the_same_attention(batch, t, length):
    query, key, value, mask = _case(batch * 1000 + t * 10 + length, batch, t, length)
    exact = _attention64(query, key, value, mask, groups=3)
    own = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    rows, folded_mask = fold_rows(query, mask, groups=3)
    folded = F.scaled_dot_product_attention(rows, key, value, attn_mask=folded_mask).view(query.shape)
    own_error, folded_error = ((x.double() - exact).abs().max().item() for x in (own, folded))
    # no further from exact attention than torch's own bf16 call, up to one bf16 rounding of an output near 1
    assert folded_error <= own_error + 2 ** -8, (own_error, folded_error)
    # the negative control: a fold that pairs query heads with the wrong KV head is far from it
    wrong = query.view(batch, 3, 3, t, 64).transpose(1, 2).reshape(query.shape)
    rows, folded_mask = fold_rows(wrong, mask, groups=3)
    mixed = F.scaled_dot_product_attention(rows, key, value, attn_mask=folded_mask).view(query.shape)
    mixed = mixed.view(batch, 3, 3, t, 64).transpose(1, 2).reshape(query.shape)
    assert (mixed.double() - exact).abs().max().item() > 10 * (own_error + 2 ** -8)


def _folds_seen(monkeypatch) -> list:
    """Record (T, masked) for every call that folds."""
    seen, fold = [], attention.fold_rows

    def counted(query, mask, groups):
        seen.append((query.shape[2], mask is not None))
        return fold(query, mask, groups)

    monkeypatch.setattr(attention, "fold_rows", counted)
    return seen


def test_the_engine_folds_its_own_bf16_calls_only(monkeypatch):
    model = make_model("llama", dtype=torch.bfloat16)  # 4 query heads over 2 KV heads
    seen = _folds_seen(monkeypatch)
    ids = prompt(seed=3, length=20)
    plain = greedy_with_scores(model, ids, 16)
    assert seen == []  # the model's own generate: transformers' sdpa, untouched
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=4)
    assert model.config._attn_implementation == ENGINE_ATTENTION  # set once, by wrap
    folded = greedy_with_scores(model, ids, 16)
    assert model.selfspec.last_stats.drafted_tokens > 0
    assert (1, False) in seen and any(t > 1 and masked for t, masked in seen)  # decoding steps and verify passes
    # the same model: bf16 rounds by pass shape, so the scores agree to bf16's precision, not bit for bit
    assert torch.equal(plain[0], folded[0])
    assert torch.allclose(plain[1], folded[1], atol=0.15, rtol=0)

    seen.clear()
    with torch.no_grad():
        own = model(ids).logits  # the wrapped model's own forward is transformers' sdpa, bit for bit
    assert seen == []
    selfspec.unwrap(model)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(own, model(ids).logits)

    selfspec.wrap(model, exit_layer=2, max_draft_tokens=4)
    monkeypatch.setenv(SWITCH, "0")
    assert greedy_with_scores(model, ids, 16)[0].shape == plain[0].shape and seen == []


def test_float32_and_ungrouped_models_never_fold(monkeypatch):
    seen = _folds_seen(monkeypatch)
    for model in (make_model("llama", dtype=torch.float32), make_model("gpt2", dtype=torch.bfloat16)):
        selfspec.wrap(model, exit_layer=2, max_draft_tokens=4)
        greedy_with_scores(model, prompt(seed=4, length=12), 16)
        assert model.selfspec.last_stats.drafted_tokens > 0
    assert seen == []


def test_nothing_is_switched_per_forward(monkeypatch):
    """The engine's calls reach its attention by a keyword argument, not by a config or environment switched around
    each forward: what a layer sees is the same in every call while the model is wrapped."""
    import os

    model = make_model("llama", dtype=torch.bfloat16)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=4)
    seen = set()
    model.model.layers[1].self_attn.register_forward_hook(
        lambda *_: seen.add((model.config._attn_implementation, os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA"))))
    greedy_with_scores(model, prompt(seed=5, length=10), 8)
    assert seen == {(ENGINE_ATTENTION, None)}


def test_measurements_tell_folded_from_plain_attention(monkeypatch):
    """Folded steps cost less, so a study's identity (and its default name) and bench metadata record the fold."""
    from selfspec.tools.calibrate.study import _default_study_name
    from selfspec.tools.measure import model_identity

    model = selfspec.wrap(make_model("llama", dtype=torch.bfloat16), exit_layer=2)
    folded = {**model_identity(model, "tiny"), "heads": []}
    monkeypatch.setenv(SWITCH, "0")
    plain = {**model_identity(model, "tiny"), "heads": []}
    assert (folded["folded_gqa"], plain["folded_gqa"]) == (True, False)
    assert _default_study_name(folded) == _default_study_name(plain) + "-foldedgqa"
    assert model_identity(make_model("llama", dtype=torch.float32), "tiny")["folded_gqa"] is False
