"""Sampled output follows the target's distribution exactly: empirical marginals of generated tokens match the
marginals computed from the unwrapped model's logits, and a verifier that accepts every draft fails the check."""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.generation import logits_process as lp

import selfspec
import selfspec.decoding
from selfspec.sampling import sample, verify_greedy, verify_sampling
from distribution import chi_square_pvalue, exact_marginals

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


def _accept_everything(state, draft, logits):
    """Planted bug: keep every draft, then a token from p after them (ignores p/q entirely)."""
    n = draft.draft_len
    probs = torch.softmax(logits, dim=-1)
    return n, sample(probs[torch.arange(n.shape[0]), n])


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


@pytest.mark.parametrize("threshold", [0.0, 0.15])
def test_speculative_sampling_matches_target(model_and_prompt, threshold):
    model, prompt = model_and_prompt
    selfspec.wrap(model, exit_layer=1, max_draft_tokens=2, draft_confidence_threshold=threshold)
    try:
        pvalues = _sampled_pvalues(model, prompt)
        stats = model.selfspec.last_stats
    finally:
        selfspec.unwrap(model)
    assert 0.05 < stats.acceptance_rate < 0.95, stats  # both branches (accept and resample) are exercised
    assert min(pvalues) > ALPHA, pvalues


def test_negative_control_always_accept_fails(model_and_prompt, monkeypatch):
    model, prompt = model_and_prompt
    monkeypatch.setattr(selfspec.decoding, "choose", _accept_everything)
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
