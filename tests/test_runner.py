"""The runner (selfspec/runner.py) owns the passes of a call: nothing long-lived is written while a call decodes.

During `generate` the engine, the model's adapter, the call's bound adapter and its slot table refuse every attribute
assignment (the engine may record its `last_stats`, the call's result, before and after); the tokens stay Hugging
Face's. Drafters that run trees, copy heads and an attention head's own cache go through the same passes, eager and
compiled."""
from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from conftest import make_model, padded_batch, prompt

import selfspec
from selfspec import compiled, decoding
from selfspec.cache import SlotTable
from selfspec.heads import AttentionHead, MLPHead

wrap_module = importlib.import_module("selfspec.wrap")  # the module, not the function selfspec.wrap

GEN = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
RESULTS = {"last_stats"}  # what a call records on the engine when it starts and ends: its own stats


class Frozen:
    """Objects that refuse attribute assignment while they are in `objects` (a test's patched __setattr__)."""

    def __init__(self):
        self.objects: dict[int, set] = {}  # id -> the names it still allows

    def guard(self, cls, monkeypatch):
        original = cls.__setattr__

        def refusing(obj, name, value):
            allowed = self.objects.get(id(obj))
            if allowed is not None and name not in allowed:
                raise AttributeError(f"{type(obj).__name__}.{name} assigned during generate")
            original(obj, name, value)

        monkeypatch.setattr(cls, "__setattr__", refusing)

    @contextlib.contextmanager
    def holding(self, *objects, allowed=frozenset()):
        ids = [id(obj) for obj in objects]
        for i in ids:
            self.objects[i] = set(allowed)
        try:
            yield
        finally:
            for i in ids:
                self.objects.pop(i, None)


def _freeze_calls(model, monkeypatch) -> Frozen:
    """Freeze the engine and its adapter for each whole decode call, and the call's runner (bound adapter, slot
    table) for its decode loop."""
    frozen, engine = Frozen(), model.selfspec
    for cls in (type(engine), type(engine.adapter), SlotTable):
        frozen.guard(cls, monkeypatch)
    decode, loop = type(engine).decode, wrap_module.speculative_decode

    def frozen_decode(self, *args, **kwargs):
        with frozen.holding(self, self.adapter, allowed=RESULTS):
            return decode(self, *args, **kwargs)

    def frozen_loop(runner, *args, **kwargs):
        with frozen.holding(runner.adapter, runner.slots):
            return loop(runner, *args, **kwargs)

    monkeypatch.setattr(type(engine), "decode", frozen_decode)
    monkeypatch.setattr(wrap_module, "speculative_decode", frozen_loop)
    return frozen


def _top_copy_head(model):
    torch.manual_seed(5)
    hidden = model.config.hidden_size
    mlp = MLPHead(2, hidden, 2 * hidden, context="top", copy_max=2)
    torch.nn.init.normal_(mlp.down.weight, std=0.001)
    return mlp.to(model.dtype)


# compiled, it compiles a tree's passes (about 20 s on one core): the full suite runs it, the fast subset eager only
@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_nothing_long_lived_is_written_during_generate(compile, monkeypatch):
    model = make_model("llama", dtype=torch.float32)
    ids, (batch, mask) = prompt(seed=3, length=10), padded_batch(seed=4)
    plain = [model.generate(ids, **GEN), model.generate(batch, attention_mask=mask, **GEN)]
    selfspec.wrap(model, drafter="hybrid", exit_layer=2, max_draft_tokens=4, compile=compile)
    model.selfspec.add_head(_top_copy_head(model))
    if compile:  # one graph per layer range, whatever the pass size: what is written does not depend on the shape
        compiled.step_for(model, model.device).dynamic_tokens = True
    _freeze_calls(model, monkeypatch)
    # compiled, the tree alone: its passes include every size a chain's make
    settings = [dict(draft_tree_top_k=1)] * (not compile) + [dict(draft_tree_top_k=2, draft_tree_size=6)]
    try:
        for setting in settings:
            model.selfspec.config = model.selfspec.config.replace(**setting)
            assert torch.equal(model.generate(ids, **GEN), plain[0])
            assert model.selfspec.last_stats.accepted_tokens > 0
            assert torch.equal(model.generate(batch, attention_mask=mask, **GEN), plain[1])
        assert model.selfspec.adapter.home is None and model.selfspec.adapter.compiled is None
    finally:
        selfspec.unwrap(model)


def test_an_attention_heads_own_cache_goes_through_the_runner(monkeypatch):
    """A stateful head (its own decoder layer and KV cache, top context) drafting chains and trees in a padded
    batch: the runner's own-layer pass with the call's tree mask, nothing written on shared objects."""
    model = make_model("llama", dtype=torch.float32)
    batch, mask = padded_batch(seed=6)
    plain = model.generate(batch, attention_mask=mask, **GEN)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=3)
    model.selfspec.add_head(AttentionHead.from_model(model.selfspec.adapter, 2, context="top"))
    _freeze_calls(model, monkeypatch)
    try:
        for top_k in (1, 2):
            model.selfspec.config = model.selfspec.config.replace(draft_tree_top_k=top_k, draft_tree_size=5)
            assert torch.equal(model.generate(batch, attention_mask=mask, **GEN), plain)
            assert model.selfspec.last_stats.drafted_tokens > 0
    finally:
        selfspec.unwrap(model)


def test_a_call_that_writes_the_slot_table_is_caught(monkeypatch):
    """The guard can fail: a loop that records its tree on the slot table (as a mode flag) is refused."""
    model = make_model("llama", dtype=torch.float32)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=3, draft_tree_top_k=2, draft_tree_size=5)
    _freeze_calls(model, monkeypatch)
    verify = decoding.verify

    def flagging(state, draft, exit_layer):
        state.runner.slots.tree = draft.parents  # the shared-state mode flag the runner replaced
        return verify(state, draft, exit_layer)

    monkeypatch.setattr(decoding, "verify", flagging)
    try:
        with pytest.raises(AttributeError, match="SlotTable.tree assigned during generate"):
            model.generate(prompt(seed=3, length=10), **GEN)
    finally:
        selfspec.unwrap(model)
