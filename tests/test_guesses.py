"""Guessed inputs in a copy head's chain: the lookup's continuation runs through layers [0, E) in the pass of the
next input, and only the guesses the head then drafts are kept. The chain must draft exactly what one token a pass
drafts, step by step, with fewer passes, and the output stays plain generate's (sampling: test_drafters' cases)."""
from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.drafters.early_exit import EarlyExitDrafter
from selfspec.heads import MLPHead
from conftest import make_model

GEN = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)


def _copy_head(context: str) -> MLPHead:
    """A copy head at layer 2 that trusts long matches: its chains follow the lookup, so guesses get confirmed."""
    torch.manual_seed(0)
    head = MLPHead(2, 32, 48, context=context, copy_max=3).double()
    for w in [head.down.weight] + ([head.top_in.weight] if context == "top" else []):
        torch.nn.init.normal_(w, std=0.2)
    with torch.no_grad():
        head.copy_bias.copy_(torch.tensor([0.0, 2.0, 4.0, 8.0]))
    return head


def _repeating_batch():
    """(2, T) rows that each repeat a span of their own (left-padded, mask): lookups match, and row 1's shorter
    span makes the rows' matches and guesses differ in length."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(3, 96, (7,), generator=g), torch.randint(3, 96, (5,), generator=g)
    rows = [torch.cat([a, a, a[:3]]), torch.cat([b, b, b[:2]])]
    width = max(len(r) for r in rows)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


def _run(model, head, ids, mask, guess: bool, gen=GEN, **cfg):
    """Generate with a copy head's chain; (output, the drafts of every step (B, k) masked by draft_len, drafter)."""
    drafter = EarlyExitDrafter(head, cfg.get("draft_confidence_threshold", 0.0), guess=guess)
    drafts = []
    propose = drafter.propose

    def recording(state, k):
        draft = propose(state, k)
        keep = torch.arange(draft.k)[None, :] < draft.draft_len[:, None]
        drafts.append(draft.tokens.masked_fill(~keep, -1).tolist())
        return draft

    drafter.propose = recording
    selfspec.wrap(model, exit_layer=2, **cfg)
    model.selfspec.add_head(head)
    model.selfspec.drafter_override = drafter
    try:
        out = model.generate(ids, attention_mask=mask, **gen)
    finally:
        selfspec.unwrap(model)
    return out, drafts, drafter


@pytest.mark.parametrize("context", ["early", "top"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("rows", [1, 2])
def test_guessed_chain_drafts_what_one_token_a_pass_drafts(family, context, rows):
    model = make_model(family, 4)
    ids, mask = _repeating_batch()
    ids, mask = ids[:rows], mask[:rows]
    ref = model.generate(ids, attention_mask=mask, **GEN)
    head = _copy_head(context)
    for cfg in (dict(max_draft_tokens=6), dict(max_draft_tokens=4, draft_confidence_threshold=0.3)):
        out, drafts, guessing = _run(model, head, ids, mask, True, **cfg)
        plain_out, plain_drafts, plain = _run(model, head, ids, mask, False, **cfg)
        assert torch.equal(out, ref) and torch.equal(plain_out, ref), cfg
        assert drafts == plain_drafts, cfg  # the same drafts, step by step
        assert guessing.guessed > 0 and plain.guessed == 0, cfg  # the guess path ran, and saved passes
        assert guessing.passes + guessing.guessed == plain.passes, cfg


@pytest.mark.parametrize("rows", [1, 2])
def test_guessed_chain_samples_what_one_token_a_pass_samples(rows):
    """Sampling draws one sample per drafted column in the same order either way, so with one seed the two chains
    must draft and emit the same tokens: the guessed chain's q and inputs are the exact chain's (whose output
    distribution test_drafters checks against the model's). Fails when a guess is confirmed by the head's argmax
    instead of its sample, or when a refuted guess's input is kept."""
    model = make_model("llama", 4)
    ids, mask = _repeating_batch()
    ids, mask = ids[:rows], mask[:rows]
    head = _copy_head("top")
    sample = dict(GEN, do_sample=True, temperature=0.8, max_new_tokens=32)
    guessed = 0
    for seed in range(6):
        torch.manual_seed(seed)
        out, drafts, guessing = _run(model, head, ids, mask, True, gen=sample, max_draft_tokens=6)
        torch.manual_seed(seed)
        plain_out, plain_drafts, _ = _run(model, head, ids, mask, False, gen=sample, max_draft_tokens=6)
        assert torch.equal(out, plain_out) and drafts == plain_drafts, seed
        guessed += guessing.guessed
    assert guessed > 10, guessed


def test_guessed_chain_keeps_float32_identity_on_a_repeating_prompt():
    """float32, where rounding could tell a pass over several inputs from one over one: still plain generate's."""
    model = make_model("llama", 4, dtype=torch.float32)
    ids, mask = _repeating_batch()
    ref = model.generate(ids, attention_mask=mask, **GEN)
    out, _, drafter = _run(model, _copy_head("top").float(), ids, mask, True, max_draft_tokens=6)
    assert torch.equal(out, ref) and drafter.guessed > 0


# --- sampling: the guessed chain's drafts and q are the one-token-a-pass chain's, so the output follows p ------

CALLS = 1500  # batch-1 calls: a batch keeps a guess only where every drafting row drafted it


def _sampled_with_guesses():
    from distribution import chi_square_pvalue, exact_marginals
    from test_drafters import PROCESSORS, PROMPT, SAMPLE, STEPS, _copy_head, _tiny

    model = _tiny(11)
    exact = exact_marginals(model, PROMPT, STEPS, PROCESSORS)
    head = _copy_head(model.config.hidden_size, model.dtype)
    drafter = EarlyExitDrafter(head, 0.0)
    selfspec.wrap(model, exit_layer=1, max_draft_tokens=3)
    model.selfspec.add_head(head)
    model.selfspec.drafter_override = drafter
    try:
        torch.manual_seed(99)
        out = torch.cat([model.generate(PROMPT, **SAMPLE)[:, PROMPT.shape[1]:] for _ in range(CALLS)])
    finally:
        selfspec.unwrap(model)
    return [chi_square_pvalue(out[:, t], exact[t]) for t in range(STEPS)], drafter


@pytest.mark.slow  # a minute: batch-1 calls
def test_guessed_chain_sampling_matches_target():
    pvalues, drafter = _sampled_with_guesses()
    assert drafter.guessed > CALLS // 10, (drafter.passes, drafter.guessed)  # the guess path is well exercised
    assert min(pvalues) > 1e-4, pvalues


@pytest.mark.slow
def test_guessed_chain_sampling_negative_control(monkeypatch):
    """The same check fails on a verifier that keeps every draft: it has the power to see a wrong output."""
    from distribution import accept_everything

    monkeypatch.setattr(selfspec.decoding, "choose", accept_everything)
    pvalues, _ = _sampled_with_guesses()
    assert min(pvalues[1:]) < 1e-4, pvalues
