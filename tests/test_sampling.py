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
from selfspec.sampling import sample, verify_greedy, verify_sampling
from distribution import accept_everything, chi_square_pvalue, exact_marginals

VOCAB, ROWS, STEPS = 10, 6000, 4
ALPHA = 1e-4


def _tiny_model():
    torch.manual_seed(11)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=None)
    model = tf.LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():  # sharpen the logits a little so that the distributions are not near uniform
        model.lm_head.weight.mul_(4.0)
    return model


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


def test_unwrapped_sampler_passes_the_check(model_and_prompt):
    """Calibrates the check itself: HF's own sampler must pass it."""
    model, prompt = model_and_prompt
    assert min(_sampled_pvalues(model, prompt)) > ALPHA


@pytest.mark.parametrize("threshold,cumulative", [(0.0, False), (0.15, False), (0.15, True)])
def test_speculative_sampling_matches_target(model_and_prompt, threshold, cumulative):
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


def test_padded_penalised_batch_matches_target(model_and_prompt, exact_penalised):
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


@pytest.mark.parametrize("plant", ["accept_everything", _drafts_left_out_of_the_prefix, _penalise_the_padding])
def test_padded_penalised_batch_negative_controls_fail(model_and_prompt, exact_penalised, monkeypatch, plant):
    if plant == "accept_everything":
        monkeypatch.setattr(selfspec.decoding, "choose", accept_everything)
    else:
        plant(monkeypatch)
    pvalues, _ = _wrapped_padded_pvalues(model_and_prompt[0], exact_penalised)
    assert min(pvalues) < ALPHA, pvalues
