"""The split forward's ways of running faster change no bits: grouped KV heads attended in place under a mask."""
from __future__ import annotations

import os

import pytest
import torch

import selfspec
from conftest import TEST_DEVICE, greedy_with_scores, make_model, prompt
from selfspec.attention import SWITCH

FORCE = "TRANSFORMERS_SDPA_FORCE_GQA"


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="in place only on CPU (CUDA's masked grouped sdpa is slower)")
def test_masked_passes_attend_grouped_heads_in_place_with_the_same_bits(monkeypatch):
    monkeypatch.setenv(SWITCH, "0")  # folded calls (test_attention.py) would not reach transformers' sdpa
    model = make_model("llama", dtype=torch.bfloat16)  # 4 query heads over 2 KV heads
    seen = []
    model.model.layers[1].self_attn.register_forward_hook(lambda *_: seen.append(os.environ.get(FORCE)))
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=4)
    ids = prompt(seed=3, length=20)
    in_place = greedy_with_scores(model, ids)
    assert model.selfspec.last_stats.drafted_tokens > 0  # verify passes with masks ran
    assert "1" in seen and FORCE not in os.environ  # they ran with it, and it was put back afterwards
    seen.clear()
    monkeypatch.setenv(FORCE, "0")  # a value the user set wins: transformers' repeat_kv copies
    copied = greedy_with_scores(model, ids)
    assert set(seen) == {"0"}
    assert torch.equal(in_place[0], copied[0]) and torch.equal(in_place[1], copied[1])
