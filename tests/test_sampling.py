"""Sampled output follows the target's distribution exactly: empirical marginals of generated tokens match the
marginals computed from the unwrapped model's logits, and a verifier that accepts every draft fails the check.
Also for a left-padded batch of rows of different lengths under a processor that reads each row's prefix
(repetition penalty), where planted prefix bugs (drafts left out of a position's prefix, padding penalised) fail."""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.generation import logits_process as lp

import selfspec
import selfspec.decoding
from selfspec.sampling import sample, verify_greedy, verify_sampling, verify_sampling_lazy
from conftest import TEST_DEVICE
from distribution import accept_everything, chi_square_pvalue, exact_marginals

VOCAB, ROWS, STEPS = 10, 6000, 4
ALPHA = 1e-4


def _tiny_model():
    """Drawn on the CPU, then moved to the test device: the same model everywhere, so the negative controls keep
    the power they have on it (drawn by a GPU's generator it is another model, on which two planted bugs went
    unseen on an H200: p 0.03-0.04 against 1e-16 on the CPU's model)."""
    torch.manual_seed(11)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=None)
    with torch.device("cpu"):
        model = tf.LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():  # sharpen the logits a little so that the distributions are not near uniform
        model.lm_head.weight.mul_(4.0)
    return model.to(TEST_DEVICE)


GEN = dict(do_sample=True, temperature=0.9, top_k=8, max_new_tokens=STEPS, pad_token_id=0)
PROCESSORS = lp.LogitsProcessorList([lp.TemperatureLogitsWarper(0.9), lp.TopKLogitsWarper(8)])


def _sampled_pvalues(model, prompt):
    torch.manual_seed(1234)
    out = model.generate(prompt.repeat(ROWS, 1), **GEN)[:, prompt.shape[1]:]
    exact = exact_marginals(model, prompt, STEPS, PROCESSORS)
    return [chi_square_pvalue(out[:, t], exact[t]) for t in range(STEPS)]


@pytest.fixture(scope="module")
def model_and_prompt():
    return _tiny_model(), torch.tensor([[3, 7, 5, 2]])


@pytest.fixture(params=["lazy", "eager"])
def verdict(request, monkeypatch):
    """Both ways verification processes the target's logits: column by column up to the first rejection (lazy, the
    CPU's way with processors) and all columns at once (eager, a GPU's)."""
    monkeypatch.setattr(selfspec.decoding, "lazy_processing", lambda state: request.param == "lazy")
    return request.param


def test_unwrapped_sampler_passes_the_check(model_and_prompt):
    """Calibrates the check itself: HF's own sampler must pass it."""
    model, prompt = model_and_prompt
    assert min(_sampled_pvalues(model, prompt)) > ALPHA


@pytest.mark.parametrize("threshold,cumulative", [(0.0, False), (0.15, False), (0.15, True)])
def test_speculative_sampling_matches_target(model_and_prompt, threshold, cumulative, verdict):
    model, prompt = model_and_prompt
    selfspec.wrap(model, exit_layer=1, max_draft_tokens=2, draft_confidence_threshold=threshold,
                  draft_confidence_cumulative=cumulative)
    try:
        pvalues = _sampled_pvalues(model, prompt)
        stats = model.selfspec.last_stats
    finally:
        selfspec.unwrap(model)
    assert 0.05 < stats.acceptance_rate < 0.95, stats  # both branches (accept and resample) are exercised
    assert min(pvalues) > ALPHA, pvalues


def test_negative_control_always_accept_fails(model_and_prompt, monkeypatch):
    model, prompt = model_and_prompt
    monkeypatch.setattr(selfspec.decoding, "choose", accept_everything)
    selfspec.wrap(model, exit_layer=1, max_draft_tokens=2)
    try:
        pvalues = _sampled_pvalues(model, prompt)
    finally:
        selfspec.unwrap(model)
    assert min(pvalues[1:]) < ALPHA, pvalues  # the drafted positions are off


@pytest.mark.parametrize("kind", ["attn-top", "fused"])
def test_sampling_with_an_attention_head_matches_target_and_its_planted_bug_does_not(model_and_prompt, monkeypatch,
                                                                                     kind):
    """A head with sequence context (its own cache over the final states of verified positions, context="top"; or
    a fused head's over layer-E states fused with the final state before each) drafts from a distribution of its
    own; rejection sampling keeps the output the target's. Accepting every draft (planted) puts the drafted
    positions off, which the same check sees."""
    from selfspec.heads import AttentionHead, FusedHead

    model, prompt = model_and_prompt

    def head(adapter):
        if kind == "attn-top":
            return AttentionHead.from_model(adapter, 1, context="top")
        fused = FusedHead.from_model(adapter, 1)
        with torch.no_grad():  # its layer's change mixed in, and the previous state read: a distribution of its own
            fused.mix.fill_(1.0)
            torch.nn.init.normal_(fused.mlp.top_in.weight, std=0.05)
        return fused

    def sampled():
        selfspec.wrap(model, exit_layer=1, max_draft_tokens=2)
        model.selfspec.add_head(head(model.selfspec.adapter))
        try:
            return _sampled_pvalues(model, prompt), model.selfspec.last_stats
        finally:
            selfspec.unwrap(model)

    pvalues, stats = sampled()
    assert 0.05 < stats.acceptance_rate < 0.95, stats
    assert min(pvalues) > ALPHA, pvalues
    monkeypatch.setattr(selfspec.decoding, "choose", accept_everything)
    pvalues, _ = sampled()
    assert min(pvalues[1:]) < ALPHA, pvalues


# --- the pure functions on hand-made distributions ------------------------------------------------------------

def test_verify_sampling_single_position_distribution():
    """One drafted position, q and p known: the emitted first token is distributed as p."""
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.1, 0.4, 0.4])
    rows = 40000
    draft = sample(q.expand(rows, 4))[:, None]
    n, nxt = verify_sampling(draft, p.expand(rows, 2, 4).clone(), q.expand(rows, 1, 4).clone(),
                             torch.ones(rows, dtype=torch.long))
    first = torch.where(n > 0, draft[:, 0], nxt)
    assert chi_square_pvalue(first, p) > ALPHA
    assert chi_square_pvalue(draft[:, 0], p) < ALPHA  # negative control: the raw drafts are not p


def test_verify_sampling_point_mass_and_empty_residual():
    torch.manual_seed(0)
    rows = 40000
    p = torch.tensor([0.6, 0.4, 0.0])
    draft = torch.zeros(rows, 1, dtype=torch.long)  # deterministic draft of token 0
    n, nxt = verify_sampling(draft, p.expand(rows, 2, 3).clone(), None, torch.ones(rows, dtype=torch.long))
    first = torch.where(n > 0, draft[:, 0], nxt)
    assert chi_square_pvalue(first, p) > ALPHA
    assert abs(n.double().mean().item() - 0.6) < 0.01  # accepted with probability p(x)
    # q == p: the residual is empty on every rejection path; acceptance is certain and nothing breaks
    n2, _ = verify_sampling(draft, p.expand(rows, 2, 3).clone(), p.expand(rows, 1, 3).clone(),
                            torch.ones(rows, dtype=torch.long))
    assert bool((n2 == 1).all())


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.usefixtures("on_cpu")
def test_lazy_verdict_makes_the_eager_ones_draws(point_mass):
    """verify_sampling_lazy draws what verify_sampling draws, so on the same distributions it returns the same n and
    token; it asks for the columns 0..max(n) in order and for none after them."""
    gen = torch.Generator().manual_seed(3)
    rows, k, vocab = 64, 4, 6
    for trial in range(20):
        p = torch.rand(rows, k + 1, vocab, generator=gen).mul(4).softmax(-1)
        q = None if point_mass else torch.rand(rows, k, vocab, generator=gen).mul(4).softmax(-1)
        draft = torch.randint(vocab, (rows, k), generator=gen)
        draft_len = torch.randint(0, k + 1, (rows,), generator=gen)
        torch.manual_seed(trial)
        n, token = verify_sampling(draft, p, q, draft_len)
        asked = []
        torch.manual_seed(trial)
        n_lazy, token_lazy = verify_sampling_lazy(draft, lambda j: asked.append(j) or p[:, j], q, draft_len)
        assert torch.equal(n, n_lazy) and torch.equal(token, token_lazy), trial
        assert asked == list(range(int(n.max()) + 1)), (asked, n.max())


def test_lazy_verdict_stops_at_the_first_rejection():
    """Drafts the target gives no mass are rejected at column 0 in every row: no later column is processed."""
    rows, k, vocab = 8, 4, 5
    p = torch.tensor([0.0, 0.4, 0.3, 0.2, 0.1]).expand(rows, k + 1, vocab)
    asked = []
    n, token = verify_sampling_lazy(torch.zeros(rows, k, dtype=torch.long), lambda j: asked.append(j) or p[:, j],
                                    None, torch.full((rows,), k))
    assert asked == [0] and bool((n == 0).all()) and bool((token != 0).all())


@pytest.mark.parametrize("tree", [False, True])
def test_lazy_and_eager_verdicts_sample_the_same_tokens(model_and_prompt, monkeypatch, tree):
    """Processing the target's logits column by column (or a tree's walked nodes one level at a time) gives each
    row the bits that processing them all at once gives, so seeded generations under top-p are identical."""
    model, prompt = model_and_prompt
    shape = dict(draft_tree_top_k=2, draft_tree_size=4) if tree else {}
    selfspec.wrap(model, exit_layer=1, max_draft_tokens=3, **shape)
    outs = []
    try:
        for lazy in (True, False):
            monkeypatch.setattr(selfspec.decoding, "lazy_processing", lambda state, lazy=lazy: lazy)
            torch.manual_seed(5)
            outs.append(model.generate(prompt.repeat(32, 1), do_sample=True, temperature=0.8, top_p=0.8,
                                       max_new_tokens=8, pad_token_id=0))
    finally:
        selfspec.unwrap(model)
    assert torch.equal(outs[0], outs[1])


def test_verify_greedy_caps_at_draft_len():
    logits = torch.full((2, 4, 5), -1.0)
    logits[:, 0, 1] = logits[:, 1, 2] = logits[:, 2, 3] = logits[:, 3, 4] = 1.0
    draft = torch.tensor([[1, 2, 3], [1, 0, 3]])
    n, nxt = verify_greedy(draft, logits, torch.tensor([2, 3]))
    assert n.tolist() == [2, 1] and nxt.tolist() == [3, 2]


# --- a left-padded batch of rows of different lengths, with a processor that reads the prefix ---------------------

PROMPTS = [[3, 7, 5, 2], [4, 6, 9, 8, 3, 6]]  # padded to 6: the first row gets two pad tokens (id 0) on the left
# A penalty below 1 rewards tokens already in the prefix; 0.2 makes the distribution of every position depend
# strongly on its prefix, so that a position scored with the wrong prefix shows in the marginals (at 1.8 a
# position scored without the drafts before it stays within the test's noise).
PENALTY = dict(GEN, repetition_penalty=0.2)
PENALTY_PROCESSORS = lp.LogitsProcessorList([lp.RepetitionPenaltyLogitsProcessor(0.2), *PROCESSORS])


def _padded_rows():
    """(ROWS, 6) left-padded batch: ROWS / 2 copies of each prompt, interleaved, and its attention mask."""
    width = max(map(len, PROMPTS))
    ids = torch.zeros(ROWS, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r in range(ROWS):
        row = PROMPTS[r % len(PROMPTS)]
        ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):] = 1
    return ids, mask


@pytest.fixture(scope="module")
def exact_penalised(model_and_prompt):
    """Exact marginals of each prompt on its own (no padding) under repetition penalty, temperature and top-k."""
    model, _ = model_and_prompt
    return [exact_marginals(model, torch.tensor([p]), STEPS, PENALTY_PROCESSORS) for p in PROMPTS]


def _padded_pvalues(model, exact):
    ids, mask = _padded_rows()
    torch.manual_seed(4321)
    out = model.generate(ids, attention_mask=mask, **PENALTY)[:, ids.shape[1]:]
    return [chi_square_pvalue(out[i :: len(PROMPTS), t], exact[i][t]) for i in range(len(PROMPTS))
            for t in range(STEPS)]


def test_padded_penalised_batch_unwrapped_passes_the_check(model_and_prompt, exact_penalised):
    """Calibrates the check: HF's sampler on the padded batch (its penalty ignores each row's padding)."""
    assert min(_padded_pvalues(model_and_prompt[0], exact_penalised)) > ALPHA


def _wrapped_padded_pvalues(model, exact):
    selfspec.wrap(model, exit_layer=1, max_draft_tokens=2)
    try:
        return _padded_pvalues(model, exact), model.selfspec.last_stats
    finally:
        selfspec.unwrap(model)


def test_padded_penalised_batch_matches_target(model_and_prompt, exact_penalised, verdict):
    """Rows of different prompt lengths that accept different numbers of drafts: the repetition penalty of every
    drafted and verified position must see exactly its own row's prefix (and not its padding)."""
    pvalues, stats = _wrapped_padded_pvalues(model_and_prompt[0], exact_penalised)
    assert 0.05 < stats.acceptance_rate < 0.95, stats
    assert min(pvalues) > ALPHA, pvalues


def _drafts_left_out_of_the_prefix(monkeypatch):
    """Planted bug: every scored position sees only its row's verified text, not the drafts before it (the penalty
    misses the tokens drafted earlier in the same step)."""
    from selfspec.processing import PrefixProcessor

    original = PrefixProcessor.__call__
    monkeypatch.setattr(PrefixProcessor, "__call__", lambda self, seq, lengths, logits: torch.cat(
        [original(self, seq, lengths, logits[:, j : j + 1]) for j in range(logits.shape[1])], dim=1))


def _column_offsets_dropped(monkeypatch):
    """Planted bug for the lazy verdict, which processes one column at a time: a column is processed as if it came
    right after the verified text, without the drafts before it in its prefix."""
    original = selfspec.decoding.DecodeState.process
    monkeypatch.setattr(selfspec.decoding.DecodeState, "process",
                        lambda self, logits, offset=0: original(self, logits))


def _penalise_the_padding(monkeypatch):
    """Planted bug: the per-row padding lengths of HF's repetition penalty are dropped, so pad id 0 is penalised."""
    import selfspec.processing

    original = selfspec.processing.PrefixProcessor.__init__

    def init(self, processors):
        original(self, processors)
        for p in self.processors:
            if isinstance(p, lp.RepetitionPenaltyLogitsProcessor):
                p.prompt_ignore_length = None

    monkeypatch.setattr(selfspec.processing.PrefixProcessor, "__init__", init)


@pytest.mark.parametrize("plant,lazy", [("accept_everything", True), (_drafts_left_out_of_the_prefix, False),
                                        (_column_offsets_dropped, True), (_penalise_the_padding, True)])
def test_padded_penalised_batch_negative_controls_fail(model_and_prompt, exact_penalised, monkeypatch, plant, lazy):
    monkeypatch.setattr(selfspec.decoding, "lazy_processing", lambda state: lazy)
    if plant == "accept_everything":
        monkeypatch.setattr(selfspec.decoding, "choose", accept_everything)
    else:
        plant(monkeypatch)
    pvalues, _ = _wrapped_padded_pvalues(model_and_prompt[0], exact_penalised)
    assert min(pvalues) < ALPHA, pvalues
