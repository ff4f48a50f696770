"""The drafter's KV of layers [0, E) is the verifier's own: counted with forward hooks on the decoder layers. And
between steps of the real loop every layer of the shared cache holds exactly the verified prefix: checked after
every step through the drafter's `accepted` hook, against a fresh forward of the verified tokens."""
from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.cache import SlotTable, SpecCache
from selfspec.drafters import build_drafter
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
    """SpecCache.rollback cuts each layer on its own (the loop's use of it is checked below, on the real loop)."""
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


# --- the between-step invariant, on the real loop ---------------------------------------------------------------

class CacheInvariantError(AssertionError):
    pass


class CacheInvariant:
    """Hooks a drafter instance so that after every step of the real decode loop (its `accepted` hook runs after
    verification and rollback) the shared cache is checked:

    * every layer holds the same number of slots: the step's base (the verified prefix before it) plus the most
      verified inputs (pending token + accepted drafts) any row kept;
    * each unfinished row's live slots hold exactly positions 0 .. pos - 1 in order (its prompt and the tokens
      verified so far; the pending token is not in the cache yet), all other slots are holes;
    * in every layer, the keys and values of those slots equal a fresh full forward of the plain model over the
      row's verified tokens (float32 tolerance)."""

    def __init__(self, model, drafter, atol: float = 1e-4):
        self.model, self.atol = model, atol
        self.steps = self.rows = 0
        self.base = None
        propose, accepted = drafter.propose, drafter.accepted

        def checked_propose(state, *args, **kwargs):
            self.base = state.verified_len
            return propose(state, *args, **kwargs)

        def checked_accepted(state, draft, n, *args, **kwargs):
            accepted(state, draft, n, *args, **kwargs)
            self.check(state, n)

        drafter.propose, drafter.accepted = checked_propose, checked_accepted

    def fail(self, message: str):
        raise CacheInvariantError(f"cache invariant broken after step {self.steps + 1}: {message}")

    @torch.no_grad()
    def check(self, state, n: torch.Tensor) -> None:
        runner, layers = state._state.runner, state.adapter.num_layers  # the loop's own cache, behind the view
        lengths = [runner.cache.layer_length(i) for i in range(layers)]
        expected = self.base + int(n.max()) + 1
        if lengths != [expected] * layers:
            self.fail(f"layer lengths {lengths}, expected base {self.base} + max keep {int(n.max()) + 1} = "
                      f"{expected} in every layer")
        slots = runner.slots.view(expected)
        mask = state.mask if state.mask is not None else torch.ones_like(state.seq[:, : state.prompt_len])
        for b in range(state.batch):
            if bool(state.finished[b]):
                continue  # a finished row's slots are never read again
            pos = int(state.pos[b])
            live = slots[b] >= 0
            if slots[b][live].tolist() != list(range(pos)):
                self.fail(f"row {b} holds positions {slots[b][live].tolist()}, expected 0..{pos - 1}")
            start = state.prompt_len - int(mask[b].sum())  # left padding
            tokens = state.seq[b, start : start + pos]
            if start + pos != int(state.seq_len[b]) - 1:
                self.fail(f"row {b}: {pos} verified positions but {int(state.seq_len[b]) - 1 - start} tokens")
            out = self.model(tokens[None].to(self.model.device), use_cache=True)
            fresh = getattr(out, "cache", None) or out.past_key_values
            for i in range(layers):
                for kind in ("keys", "values"):
                    got = getattr(runner.cache.layers[i], kind)[b][:, live]
                    want = getattr(fresh.layers[i], kind)[0]
                    if not torch.allclose(got, want, atol=self.atol, rtol=self.atol):
                        self.fail(f"row {b}, layer {i}: {kind} differ from a fresh forward of the verified tokens "
                                  f"by {float((got - want).abs().max()):.3g}")
            self.rows += 1
        self.steps += 1


CASES = {
    "early_exit": dict(drafter="early_exit", exit_layer=EXIT, max_draft_tokens=4),
    "hybrid": dict(drafter="hybrid", exit_layer=EXIT, max_draft_tokens=4, hybrid_min_match=1),
    "ngram": dict(drafter="ngram", exit_layer=EXIT, max_draft_tokens=4),
    # a copy head's chain running past K=1 while it copies (test_copy_runs): the KV of drafts past K is kept too
    "copy-runs": dict(drafter="early_exit", exit_layer=EXIT, max_draft_tokens=1, copy_draft_tokens=6),
    # the hybrid's lookups of 2+ token matches running past K=1, beside head drafts in the same steps
    "hybrid-runs": dict(drafter="hybrid", exit_layer=EXIT, max_draft_tokens=1, copy_draft_tokens=6,
                        hybrid_min_match=2),
}


def _repetitive_batch(lengths=(13, 6, 10)):
    """Left-padded (3, T) batch whose rows repeat a short unit, so that n-gram drafts are made too."""
    g = torch.Generator().manual_seed(2)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        unit = torch.randint(3, 96, (3 + row,), generator=g, device="cpu")
        ids[row, ids.shape[1] - n:] = unit.repeat(n // len(unit) + 1)[:n]
        mask[row, ids.shape[1] - n:] = 1
    return ids, mask


def _checked_generate(case: str, eos: bool = True):
    """Padded batch of 3 rows of different lengths (one of them stops at EOS early) through the real loop with the
    invariant checked after every step. Returns (output, reference, stats, checker)."""
    model = make_model("llama", LAYERS, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # rows run to max_new_tokens unless an EOS is given below
    ids, mask = _repetitive_batch()
    gen = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    if eos:
        free = model.generate(ids, attention_mask=mask, **gen)
        gen["eos_token_id"] = int(free[1, ids.shape[1] + 6])  # row 1 stops after 7 tokens (others maybe too)
    ref = model.generate(ids, attention_mask=mask, **gen)
    selfspec.wrap(model, **CASES[case])
    if CASES[case].get("copy_draft_tokens") and CASES[case]["drafter"] == "early_exit":
        from test_copy_runs import _copy_head

        model.selfspec.add_head(_copy_head(model.config.hidden_size, model.dtype, exit_layer=EXIT))
    try:
        drafter = model.selfspec.drafter_override = build_drafter(model.selfspec)
        checker = CacheInvariant(model, drafter)
        out = model.generate(ids, attention_mask=mask, **gen)
        return out, ref, model.selfspec.last_stats, checker
    finally:
        selfspec.unwrap(model)


@pytest.mark.parametrize("case", sorted(CASES))
def test_real_loop_keeps_exactly_the_verified_prefix(case):
    out, ref, stats, checker = _checked_generate(case)
    assert torch.equal(out, ref)
    assert checker.steps > 0 and checker.rows > checker.steps  # several rows checked per step
    assert stats.accepted_tokens > 0 and stats.acceptance_rate < 1  # drafts accepted and rejected: holes were made
    assert (out[:, -1] == 0).any()  # a row finished early, so finished rows were in the batch too
    if CASES[case].get("copy_draft_tokens"):  # chains did run past K (more drafts a row-step than K)
        assert stats.drafted_tokens > CASES[case]["max_draft_tokens"] * (stats.verify_steps - out.shape[0]), stats


def _keep_one_more_slot(monkeypatch):
    """Planted bug: the cache is cut back to one slot more than the verified prefix."""
    original = SpecCache.rollback
    monkeypatch.setattr(SpecCache, "rollback", lambda self, length: original(self, length + 1))


def _keep_one_more_draft(monkeypatch):
    """Planted bug: the slot table keeps each row's first rejected draft as if it had been accepted."""
    original = SlotTable.keep_prefix
    monkeypatch.setattr(SlotTable, "keep_prefix", lambda self, start, keep, end: original(self, start, keep + 1, end))


def _stale_kv_in_kept_slot(monkeypatch):
    """Planted bug: rollback leaves lengths and slots right but the last kept slot of the early layers with stale KV
    (as a drafter feeding the early layers a token other than the one verified would)."""
    from selfspec.cache import SpecLayer

    original = SpecLayer.truncate

    def stale(self, length):
        shortened = length < self.length
        original(self, length)
        if shortened:
            self.buffers()[0][..., length - 1, :] += 0.5

    monkeypatch.setattr(SpecLayer, "truncate", stale)


@pytest.mark.parametrize("plant", [_keep_one_more_slot, _keep_one_more_draft, _stale_kv_in_kept_slot])
def test_invariant_check_catches_a_planted_rollback_bug(monkeypatch, plant):
    plant(monkeypatch)
    with pytest.raises(CacheInvariantError, match="cache invariant broken after step"):
        _checked_generate("early_exit", eos=False)
