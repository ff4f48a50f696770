"""Chains that run past K while they copy (config.copy_draft_tokens, draft_length.py): greedy identity with the
unwrapped model, runs past K that really happen (and none without the knob), the cost model's replay counting what
the engine does, and the refusal of a head that cannot copy. Sampling exactness: test_drafters' "copy-head-run"."""
from __future__ import annotations

import pytest
import torch

import selfspec
from conftest import make_model
from selfspec.draft_length import chain_may_draft, copy_budget, draft_budget, lookup_budget
from selfspec.heads import MLPHead
from selfspec.tools import cost_model

GEN = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
K = 1


def _copy_head(hidden_size: int, dtype, trust: float = 8.0, exit_layer: int = 1):
    """An MLP copy head at `exit_layer` that drafts its copy candidate whenever the match is 2+ tokens long (`trust`
    added to the candidate's logit there), else the plain exit's choice."""
    torch.manual_seed(3)
    head = MLPHead(exit_layer, hidden_size, 2 * hidden_size, copy_max=3)
    with torch.no_grad():
        torch.nn.init.normal_(head.down.weight, std=0.02)
        head.copy_bias.copy_(torch.tensor([0.0, 0.0, trust, trust]))
    return head.to(dtype)


def _looping_prompt(seed: int, period: int = 5, length: int = 20):
    """A prompt that repeats a random unit, so that the text has long matches to copy from."""
    g = torch.Generator().manual_seed(seed)
    unit = torch.randint(3, 90, (period,), generator=g)
    return unit.repeat(length // period + 1)[:length][None, :]


def _wrapped(copy_draft_tokens: int, k: int = K):
    model = make_model("llama", 4)
    ref = {s: model.generate(_looping_prompt(s).to(model.device), **GEN) for s in range(3)}
    selfspec.wrap(model, drafter="early_exit", exit_layer=1, max_draft_tokens=k, copy_draft_tokens=copy_draft_tokens)
    model.selfspec.add_head(_copy_head(model.config.hidden_size, model.dtype))
    return model, ref


def test_the_budgets():
    """The copy budget is never below the step's budget, stays within the tokens left, and past k only a copy is
    drafted."""
    assert draft_budget(4, 100) == 4 and copy_budget(16, 4, 100) == 16
    assert copy_budget(16, draft_budget(4, 6), 6) == 5  # one fewer than the tokens left
    assert copy_budget(0, 4, 100) == 4 and copy_budget(2, 4, 100) == 4  # never below k
    assert chain_may_draft(3, 4, True, False) and not chain_may_draft(3, 4, False, True)
    assert chain_may_draft(4, 4, False, True) and not chain_may_draft(4, 4, True, False)
    assert [lookup_budget(4, 16, m) for m in (0, 1, 2, 5)] == [4, 4, 16, 16]  # a lookup copies from 2 tokens on
    assert lookup_budget(4, 16, torch.tensor([1, 2])).tolist() == [4, 16]


def test_copy_runs_pass_k_and_keep_the_output():
    """Output identical to plain greedy generate; with the knob, steps draft more than K (mean drafts per step
    above K=1), and without it never (the control)."""
    for copy_k, runs in ((8, True), (0, False)):
        model, ref = _wrapped(copy_k)
        drafted = steps = 0
        for s, want in ref.items():
            ids = _looping_prompt(s).to(model.device)
            assert torch.equal(model.generate(ids, **GEN), want), (copy_k, s)
            stats = model.selfspec.last_stats
            drafted, steps = drafted + stats.drafted_tokens, steps + stats.verify_steps - 1
        assert (drafted > K * steps) == runs, (copy_k, drafted, steps)


def test_copy_runs_in_a_padded_batch():
    model, ref = _wrapped(8)
    rows = [_looping_prompt(s, period=4 + s, length=12 + 3 * s)[0] for s in range(3)]
    width = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.numel():], mask[i, width - r.numel():] = r, 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    selfspec.unwrap(model)
    want = model.generate(ids, attention_mask=mask, **GEN)
    selfspec.wrap(model, drafter="early_exit", exit_layer=1, max_draft_tokens=K, copy_draft_tokens=8)
    model.selfspec.add_head(_copy_head(model.config.hidden_size, model.dtype))
    assert torch.equal(model.generate(ids, attention_mask=mask, **GEN), want)


@pytest.mark.parametrize("k,copy_k", [(1, 8), (2, 5)])
def test_replay_counts_the_copy_runs_the_engine_drafts(k, copy_k):
    """cost_model.simulate with copy runs gives the engine's own steps and acceptances, which only the drafts up
    to a step's first wrong one decide, and its drafted tokens, which past a wrong draft are the replay's estimate:
    exactly with K=1 (a run goes on after a wrong copy while the answer copies, as on these looping texts this
    head, which always drafts a long match's candidate, does), within 10 % with K=2. The negative control, the
    replay without copy runs, drafts fewer."""
    model, ref = _wrapped(copy_k, k)
    prompts = [_looping_prompt(s).to(model.device) for s in ref]
    answers = [ref[s][0, p.shape[1]:] for s, p in zip(ref, prompts)]
    seqs = [cost_model.Sequence(p, a) for p, a in zip(prompts, answers)]
    acc = cost_model.measure_acceptance(model.selfspec, seqs, [1])[1]
    assert any(any(c) for c in acc.copying)
    eos = [[False] * a.numel() for a in answers]
    counts = cost_model.simulate(acc, eos, k, 0.0, max_new_tokens=GEN["max_new_tokens"], copy_draft_tokens=copy_k)
    engine = [0, 0, 0]
    for p in prompts:
        model.generate(p, **GEN)
        s = model.selfspec.last_stats
        engine = [engine[0] + s.verify_steps, engine[1] + s.drafted_tokens, engine[2] + s.accepted_tokens]
    assert engine[0::2] == [counts.steps + counts.prefills, counts.accepted]
    assert engine[1] == counts.drafted if k == 1 else abs(engine[1] - counts.drafted) <= 0.1 * engine[1]
    plain = cost_model.simulate(acc, eos, k, 0.0, max_new_tokens=GEN["max_new_tokens"])
    assert plain.drafted < counts.drafted


def test_a_head_that_cannot_copy_is_refused():
    model = make_model("llama", 4)
    selfspec.wrap(model, drafter="early_exit", exit_layer=1, max_draft_tokens=2, copy_draft_tokens=8)
    with pytest.raises(ValueError, match="copy_draft_tokens=8 .* has no copy lookup"):
        model.generate(_looping_prompt(0).to(model.device), **GEN)


@pytest.mark.parametrize("where", ["hybrid-tree", "tree", "ngram"])
def test_runs_asked_where_none_are_made_are_named(where):
    """The n-gram drafter and draft trees (the hybrid's too) draft at most K: a config asking them for runs past K
    says so once, rather than dropping the knob in silence; the output stays plain generate's."""
    import selfspec.hf

    model, ref = _wrapped(8, k=2)
    tree = dict(draft_tree_top_k=2, draft_tree_size=4)
    cfg = {"hybrid-tree": dict(drafter="hybrid", **tree), "ngram": dict(drafter="ngram"), "tree": tree}[where]
    model.selfspec.config = model.selfspec.config.replace(**cfg)
    selfspec.hf._warned.clear()
    ids = _looping_prompt(0).to(model.device)
    with pytest.warns(UserWarning, match=r"copy_draft_tokens=8 lets the chains .* at most max_draft_tok"):
        out = model.generate(ids, **GEN)
    assert torch.equal(out, ref[0])


# --- the hybrid: its lookup continuations of 2+ token matches are copies, and run to copy_draft_tokens ------------
HYBRIDS = {  # K=1: every draft past the first is a run
    "extend": dict(hybrid_min_match=2, hybrid_policy="lookup-when-unsure", draft_confidence_threshold=0.2),
    "rematch": dict(hybrid_min_match=3, ngram_max=3, hybrid_policy="lookup-when-copying"),
}


def _hybrid_drafts(model, ids, mask, copy_k: int, cfg: dict):
    """Generate with the hybrid at K=1 and runs to copy_k; returns (output, drafter, [(k, lookup, draft) per step]):
    each step's lookup (NgramProposal for copy_k drafts, taken before the drafter proposed) and its draft."""
    from selfspec.drafters import build_drafter

    selfspec.wrap(model, drafter="hybrid", exit_layer=1, max_draft_tokens=K, copy_draft_tokens=copy_k, **cfg)
    try:
        drafter = model.selfspec.drafter_override = build_drafter(model.selfspec)
        seen, propose = [], drafter.propose

        def spy(state, k):
            if k == 0:  # the last token: nothing drafted
                return propose(state, k)
            found = drafter.ngram.lookup(state, max(k, state.copy_k))
            draft = propose(state, k)
            seen.append((k, found, draft))
            return draft

        drafter.propose = spy
        out = model.generate(ids, attention_mask=mask, **GEN)
        return out, drafter, seen
    finally:
        selfspec.unwrap(model)


def _looping_batch():
    rows = [_looping_prompt(s, period=4 + s, length=12 + 3 * s)[0] for s in range(3)]
    width = max(r.numel() for r in rows)
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.numel():], mask[i, width - r.numel():] = r, 1
    return ids, mask


@pytest.mark.parametrize("how", sorted(HYBRIDS))
def test_hybrid_runs_copies_past_k(how):
    """A padded batch through the hybrid with runs to 8: output identical to plain greedy generate, steps that draft
    past K=1, and every draft past K a lookup's copy (a match of 2+ tokens; without rematch, the step's own lookup
    continuation), never the head's; without the knob (the control) no draft passes K."""
    model = make_model("llama", 4)
    ids, mask = (t.to(model.device) for t in _looping_batch())
    ref = model.generate(ids, attention_mask=mask, **GEN)
    for copy_k in (8, 0):
        out, drafter, seen = _hybrid_drafts(model, ids, mask, copy_k, HYBRIDS[how])
        assert torch.equal(out, ref), (how, copy_k)
        longest = max(int(d.draft_len.max()) for _, _, d in seen)
        assert (longest > K) == bool(copy_k), (how, copy_k, longest)
        for k, found, draft in seen:
            for b in (draft.draft_len > k).nonzero()[:, 0].tolist():
                n = int(draft.draft_len[b])
                if how == "extend":  # at the step's start: the row's whole draft is its lookup's copy
                    assert int(found.match[b]) >= 2 and int(found.length[b]) >= n, (b, found, draft)
                    assert torch.equal(draft.tokens[b, :n], found.tokens[b, :n])
        if how == "rematch":  # at K=1 only runs let a head's first draft be followed by a lookup's
            assert (drafter.steps["rematched"] > 0) == bool(copy_k), (copy_k, drafter.steps)


@pytest.mark.parametrize("bad", [-1, 2.5, "8"])
def test_copy_draft_tokens_must_be_a_count(bad):
    with pytest.raises(ValueError, match="copy_draft_tokens must be an integer >= 0"):
        selfspec.SelfSpecConfig(copy_draft_tokens=bad).validate()


# --- sampling: whether a draft past K is proposed must not hang on its own sampled value -------------------------
# The prompt makes many rows reach a run at the step after the prefill: it ends in A, and every other token t follows
# an A once and is followed by a B, so after the prefill's token t the candidate is B (the match "A t"), and after a
# drafted B it is A (the match "t B"), where K=1 ends and only a copy may go on. A run matters only where the
# drafted B was accepted, at most as often as the target gives B there, so the target (seed) and the pair are those
# of 24 random tiny models and all 56 pairs under which B, then A, are likeliest (about 0.17 and 0.14).
# test_drafters' "copy-head-run" checks the same on its prompt, where too few rows reach a run to tell this bug
# apart.
SEED, A, B = 13, 3, 7
ROWS = 20_000
COPY_PROMPT = torch.tensor([[x for t in range(2, 10) if t not in (A, B) for x in (A, t, B)] + [A]])


@pytest.fixture(scope="module")
def copy_target():
    from distribution import exact_marginals
    from test_drafters import PROCESSORS, STEPS, _tiny

    model = _tiny(SEED)
    return model, exact_marginals(model, COPY_PROMPT, STEPS, PROCESSORS)


def _sampled_with_runs(copy_target, rows: int):
    """(rows, STEPS) sampled tokens after COPY_PROMPT, drafted with runs past K=1, and how many drafts were past K."""
    from test_drafters import SAMPLE, _copy_head as sampling_copy_head

    model, _ = copy_target
    selfspec.wrap(model, drafter="early_exit", exit_layer=1, max_draft_tokens=1, copy_draft_tokens=2)
    model.selfspec.add_head(sampling_copy_head(model.config.hidden_size, model.dtype))
    try:
        torch.manual_seed(99)
        prompt = COPY_PROMPT.to(model.device).repeat(rows, 1)
        out = model.generate(prompt, **SAMPLE)[:, COPY_PROMPT.shape[1]:].cpu()
        stats = model.selfspec.last_stats
    finally:
        selfspec.unwrap(model)
    return out, stats.drafted_tokens - (stats.verify_steps - rows)


@torch.no_grad()
def _pvalue_where_runs_were_offered(model, out) -> float:
    """Token 2 of the rows whose chain reached a run (token 0 neither A nor B, token 1 the drafted B) against the
    target's own distribution after each row's tokens 0 and 1: the exact conditional marginal of those rows."""
    from distribution import chi_square_pvalue
    from test_drafters import PROCESSORS

    reached = (out[:, 1] == B) & (out[:, 0] != A) & (out[:, 0] != B)
    ids = torch.cat([COPY_PROMPT.repeat(int(reached.sum()), 1), out[reached, :2]], dim=1).to(model.device)
    logits = model(ids).logits[:, -1].float()
    probs = torch.softmax(PROCESSORS(ids, logits).double(), dim=-1).mean(0).cpu()
    return chi_square_pvalue(out[reached, 2], probs)


def test_sampled_copy_runs_follow_the_target(copy_target):
    from distribution import chi_square_pvalue
    from test_drafters import ALPHA, STEPS

    out, runs = _sampled_with_runs(copy_target, ROWS)
    assert runs > ROWS // 5, runs  # many rows' chains went past K
    model, exact = copy_target
    pvalues = [chi_square_pvalue(out[:, t], exact[t]) for t in range(STEPS)]
    assert min(pvalues) > ALPHA, pvalues
    assert _pvalue_where_runs_were_offered(model, out) > ALPHA


def test_sampled_copy_runs_negative_control(copy_target, monkeypatch):
    """Planted bug: a draft past K proposed when the sampled token itself is the candidate (the rule judges the
    distribution's top token). The candidate is then drafted there only as often as q draws it and accepted as
    often as p allows, and comes out too often where runs were offered."""
    import selfspec.drafters.early_exit as early_exit
    from selfspec.draft_logits import DraftLogits
    from test_drafters import ALPHA

    sampled = {}
    real_copying, real_choose = DraftLogits.copying, early_exit.choose_draft

    def remember(state, logits, column, scored=False):
        token, probs, top = real_choose(state, logits, column, scored)
        sampled["token"] = token
        return token, probs, top

    monkeypatch.setattr(early_exit, "choose_draft", remember)
    monkeypatch.setattr(DraftLogits, "copying", lambda self, token: real_copying(self, sampled["token"]))
    out, _ = _sampled_with_runs(copy_target, ROWS)
    assert _pvalue_where_runs_were_offered(copy_target[0], out) < ALPHA
