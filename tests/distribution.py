"""Exact next-token marginals of a small model and a chi-square check of sampled tokens against them."""
from __future__ import annotations

import itertools

import torch
from scipy.stats import chisquare


@torch.no_grad()
def exact_marginals(model, prompt_ids, steps: int, processors) -> list[torch.Tensor]:
    """P(x_t) for t < steps under ancestral sampling from `model` with HF `processors` (a LogitsProcessorList),
    by enumerating every continuation (V^(steps-1) forward passes: small vocabularies only). Returns (V,) each."""
    vocab = model.get_output_embeddings().weight.shape[0]
    marginals = [torch.zeros(vocab, dtype=torch.float64) for _ in range(steps)]
    prefixes = {(): 1.0}  # continuation -> its probability
    for t in range(steps):
        conts = list(prefixes)
        ids = torch.cat([prompt_ids.repeat(len(conts), 1), torch.tensor(conts, dtype=torch.long).view(len(conts), t)], 1)
        logits = model(ids).logits[:, -1].to(torch.float32)
        probs = torch.softmax(processors(ids, logits).double(), dim=-1)
        nxt = {}
        for row, cont in enumerate(conts):
            weighted = prefixes[cont] * probs[row]
            marginals[t] += weighted
            if t + 1 < steps:
                for tok in torch.nonzero(weighted > 0).flatten().tolist():
                    nxt[cont + (tok,)] = float(weighted[tok])
        prefixes = nxt
    return marginals


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Goodness of fit of (N,) sampled ids to (V,) probabilities; bins expecting < min_expected are pooled."""
    n = samples.numel()
    counts = torch.bincount(samples.flatten(), minlength=probs.numel()).double()
    expected = probs.double() * n
    if (counts[expected == 0] > 0).any():
        return 0.0  # a token that has probability 0 was sampled
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.cpu().numpy(), exp.cpu().numpy()).pvalue)


def accept_everything(state, draft, step):
    """A planted bug in place of decoding.choose: keep every draft, then a token from p after them (ignores p and
    q). Sampling tests patch it in to show that their check can fail."""
    from selfspec.sampling import sample

    logits = state.process(state.adapter.logits(step.top).float())
    n = draft.draft_len
    probs = torch.softmax(logits, dim=-1)
    return draft, logits, n, sample(probs[torch.arange(n.shape[0]), n]), step
