"""The split forward's ways of running faster change no bits: grouped KV heads attended in place under a mask."""
from __future__ import annotations

import pytest
import torch

import selfspec
from conftest import TEST_DEVICE, greedy_with_scores, make_model, prompt
from selfspec.attention import SWITCH, restore_attention


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="in place only on CPU (CUDA's masked grouped sdpa is slower)")
def test_masked_passes_attend_grouped_heads_in_place_with_the_same_bits(monkeypatch):
    """The engine's masked passes attend grouped KV heads in place (enable_gqa); transformers' own sdpa copies them
    to every query head (repeat_kv). The same bits either way."""
    from torch.nn import functional as F

    monkeypatch.setenv(SWITCH, "0")  # folded calls (test_attention.py) would not reach the in-place call
    model = make_model("llama", dtype=torch.bfloat16)  # 4 query heads over 2 KV heads
    grouped = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        if kwargs.get("attn_mask") is not None:
            grouped.append(kwargs.get("enable_gqa", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=4)
    ids = prompt(seed=3, length=20)
    in_place = greedy_with_scores(model, ids)
    assert model.selfspec.last_stats.drafted_tokens > 0 and any(grouped)  # verify passes with masks ran in place
    grouped.clear()
    restore_attention(model)  # the engine's calls go to transformers' sdpa: repeat_kv under a mask
    copied = greedy_with_scores(model, ids)
    assert grouped and not any(grouped)
    assert torch.equal(in_place[0], copied[0]) and torch.equal(in_place[1], copied[1])
