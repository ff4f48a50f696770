"""Logits processors that keep state between calls cannot run inside speculation (it calls them on drafts that
are later rejected, several positions per step): they go to the plain generate with a one-time warning. Processors
that declare themselves pure, and Hugging Face's own, run speculatively."""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import selfspec
from conftest import make_model, prompt
from selfspec.processing import is_pure


class CountingBan(LogitsProcessor):
    """Keeps state: counts its calls and bans one token on every third call, as a grammar or a watermark whose
    state advances per call would. Its output is right only if it is called once per emitted token."""

    def __init__(self, token: int):
        self.token, self.calls = token, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls % 3 == 0:
            scores = scores.clone()
            scores[:, self.token] = float("-inf")
        return scores


class PureBan(LogitsProcessor):
    """Bans a token after any prefix ending in another: a function of its arguments only, and says so."""

    selfspec_pure = True

    def __init__(self, after: int, token: int):
        self.after, self.token = after, token

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[input_ids[:, -1] == self.after, self.token] = float("-inf")
        return scores


@pytest.fixture(scope="module")
def model():
    return make_model("llama", 4)


def _generate(model, ids, processor):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          pad_token_id=0, logits_processor=LogitsProcessorList([processor]))


def _banned_token(model, ids):
    """A token plain greedy emits at a step that a every-third-call ban hits, so the ban changes the text."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                         pad_token_id=0)
    return int(out[0, ids.shape[1] + 2])  # the third call's token


def test_stateful_processor_falls_back_with_a_warning_and_sees_plain_calls(model):
    ids = prompt(seed=2, length=8)
    token = _banned_token(model, ids)
    plain_proc = CountingBan(token)
    want = _generate(model, ids, plain_proc)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=4)
    try:
        wrapped_proc = CountingBan(token)
        with pytest.warns(UserWarning, match="CountingBan may keep state between calls"):
            got = _generate(model, ids, wrapped_proc)
        assert model.selfspec.last_stats is None and "CountingBan" in model.selfspec.last_fallback
    finally:
        selfspec.unwrap(model)
    assert torch.equal(got, want)
    assert wrapped_proc.calls == plain_proc.calls  # one call per emitted token, as in HF's loop


def test_without_the_fallback_a_stateful_processor_goes_wrong(model, monkeypatch):
    """Negative control: run the counting processor speculatively anyway and its calls and text drift."""
    ids = prompt(seed=2, length=8)
    token = _banned_token(model, ids)
    plain_proc = CountingBan(token)
    want = _generate(model, ids, plain_proc)
    monkeypatch.setattr(CountingBan, "selfspec_pure", True, raising=False)  # a false promise
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=4)
    try:
        wrapped_proc = CountingBan(token)
        got = _generate(model, ids, wrapped_proc)
    finally:
        selfspec.unwrap(model)
    assert wrapped_proc.calls != plain_proc.calls or not torch.equal(got, want)


def test_pure_and_hugging_face_processors_run_speculatively(model):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    ids = prompt(seed=4, length=8)
    proc = PureBan(after=int(ids[0, -1]), token=5)
    want = _generate(model, ids, proc)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=4)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning
            got = _generate(model, ids, proc)
        assert model.selfspec.last_stats is not None
    finally:
        selfspec.unwrap(model)
    assert torch.equal(got, want)
    assert is_pure(RepetitionPenaltyLogitsProcessor(1.2)) and not is_pure(CountingBan(1))
