"""The drafter's KV of layers [0, E) is the verifier's own: counted with forward hooks on the decoder layers."""
from __future__ import annotations

import torch

import selfspec
from selfspec.drafters.early_exit import EarlyExitDrafter
from conftest import make_model, prompt

LAYERS, EXIT = 5, 2


def _count_positions(model, ids, **gen):
    """Generate while counting, per decoder layer, how many token positions it processed."""
    layers = model.selfspec.adapter.layers
    counts = [0] * len(layers)
    hooks = [layer.register_forward_hook(lambda mod, args, out, i=i: counts.__setitem__(i, counts[i] + args[0].shape[1]))
             for i, layer in enumerate(layers)]
    try:
        out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, **gen)
    finally:
        for h in hooks:
            h.remove()
    return out, counts


def test_every_layer_processes_each_position_once():
    model = make_model("llama", LAYERS)
    ids = prompt(seed=4)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    selfspec.wrap(model, exit_layer=EXIT, max_draft_tokens=4)
    out, counts = _count_positions(model, ids)
    stats = model.selfspec.last_stats
    assert torch.equal(out, ref)
    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0
    # Layers below E ran the drafts one by one while drafting, layers from E on ran them in verification;
    # each (position, token) went through every layer exactly once, so all layers saw the same count:
    # the prompt plus the k+1 inputs of every verify step.
    assert len(set(counts)) == 1, counts
    assert counts[0] < ids.shape[1] + stats.drafted_tokens + stats.verify_steps


def test_recomputing_early_layers_is_detected(monkeypatch):
    """Planted bug: a drafter that forgets its layer-E states makes verification rerun layers [0, E)
    for drafted positions (as HF's assistant_early_exit does); the counts expose it."""
    model = make_model("llama", LAYERS)
    original = EarlyExitDrafter.propose

    def forgetful(self, state, k):
        draft = original(self, state, k)
        draft.hidden = None
        return draft

    monkeypatch.setattr(EarlyExitDrafter, "propose", forgetful)
    selfspec.wrap(model, exit_layer=EXIT, max_draft_tokens=4)
    _, counts = _count_positions(model, prompt(seed=4))
    assert counts[0] > counts[-1], counts


def test_cache_rolls_back_per_layer():
    """Between steps all layers hold the same, verified, length (the invariant in cache.py)."""
    from selfspec.cache import SpecCache

    cache = SpecCache(3)
    k = torch.zeros(1, 2, 5, 4)
    for i in range(3):
        cache.update(k, k, i)
    cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)  # layer 0 drafted 3 more
    cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), 2)
    cache.rollback(6)
    assert [cache.layer_length(i) for i in range(3)] == [6, 5, 6]
    assert cache.layers[0].keys.shape[-2] == 6 and float(cache.layers[0].keys[0, 0, 5, 0]) == 1.0
