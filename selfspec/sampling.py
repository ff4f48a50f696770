"""Speculative verification as small pure functions.

p: the target's processed distribution at each verified position, (B, K+1, V).
q: the drafter's processed distribution at each drafted position, (B, K, V); None for deterministic drafters
   (greedy early exit, n-gram, oracle), whose q is a point mass on the drafted token.
`draft_len` (B,) says how many of the K drafted columns each row actually proposes.
Both return `n` (B,), the number of accepted drafts, and `next_token` (B,), the token the verifier adds.
"""
from __future__ import annotations

import torch


def logits_to_probs(logits: torch.Tensor) -> torch.Tensor:
    # float32 softmax: bf16 probabilities are too coarse for acceptance ratios
    return torch.softmax(logits.float(), dim=-1)


def sample(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of (..., V) probabilities -> (...) token ids."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1).view(probs.shape[:-1])


def accepted_prefix(accept: torch.Tensor, draft_len: torch.Tensor) -> torch.Tensor:
    """(B, K) per-draft accept flags -> (B,) length of the leading run of accepts, capped at draft_len."""
    k = accept.shape[1]
    in_draft = torch.arange(k, device=accept.device)[None, :] < draft_len[:, None]
    return torch.cumprod((accept & in_draft).long(), dim=1).sum(dim=1)


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor, draft_len: torch.Tensor):
    """Accept drafts while they equal the target's argmax; the next token is the target's argmax after them."""
    target = target_logits.argmax(dim=-1)  # (B, K+1)
    n = accepted_prefix(draft == target[:, : draft.shape[1]], draft_len)
    return n, target.gather(1, n[:, None]).squeeze(1)


def verify_sampling(draft, p, q, draft_len):
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023): the output follows p exactly."""
    k = draft.shape[1]
    if k == 0:
        return torch.zeros_like(draft_len), sample(p[:, 0])
    p_x = p[:, :k].gather(2, draft[..., None]).squeeze(2)  # p(x_j) for each drafted x_j, (B, K)
    u = torch.rand_like(p_x)
    n = accepted_prefix(u * drafted_q(draft, q) < p_x, draft_len)  # accept x_j with probability min(1, p/q)
    rows = torch.arange(draft.shape[0], device=draft.device)
    return n, correction(draft, p[rows, n], q, n, draft_len)


def verify_sampling_lazy(draft, column, q, draft_len):
    """verify_sampling with the target's distribution asked for one verify column at a time: `column(j)` -> (B, V)
    p at column j, asked in order, each once, and never past the column at which every row has stopped. Where
    processing a row is costly (top-p sorts the whole vocabulary: about 4 ms a row on one CPU core), the columns after
    every row's first rejection are then never processed. The same draws as verify_sampling, so given the same
    columns it returns the same n and token; it costs one host check per column. Columns 0..max(n) are always
    asked for (emit reads them)."""
    k = draft.shape[1]
    if k == 0:
        return torch.zeros_like(draft_len), sample(column(0))
    u = torch.rand(draft.shape, device=draft.device)  # as verify_sampling's rand_like of its float32 p(x_j)
    q_x = drafted_q(draft, q)
    cols, n = [], torch.zeros_like(draft_len)
    running = draft_len > 0  # rows whose drafts so far were all accepted and which propose column j
    for j in range(k):
        cols.append(column(j))
        taken = running & (u[:, j] * q_x[:, j] < cols[j].gather(1, draft[:, j, None])[:, 0])
        n, running = n + taken.long(), taken & (j + 1 < draft_len)
        if not bool(running.any()):
            break
    for j in range(len(cols), int(n.max()) + 1):  # the bonus column of rows that accepted every draft
        cols.append(column(j))
    p = torch.stack(cols, dim=1)  # (B, c, V)
    rows = torch.arange(draft.shape[0], device=draft.device)
    return n, correction(draft, p[rows, n], q, n, draft_len)


def drafted_q(draft, q):
    """(B, K) q(x_j) of each drafted token; a deterministic draft (q None) is a point mass, q(x_j) = 1."""
    return torch.ones(draft.shape, device=draft.device) if q is None else q.gather(2, draft[..., None]).squeeze(2)


def correction(draft, p_n, q, n, draft_len):
    """The verifier's token after n (B,) accepted drafts: from the residual norm(max(0, p - q)) at the rejected
    column, or from p_n (B, V), the target's distribution at column n, where every draft was accepted."""
    k = draft.shape[1]
    rows = torch.arange(draft.shape[0], device=draft.device)
    j = n.clamp(max=k - 1)  # rows with n == draft_len take the bonus path below; any valid index will do
    if q is None:
        q_n = torch.zeros_like(p_n)
        q_n[rows, draft[rows, j]] = 1.0  # p with the rejected point mass removed, once renormalised
    else:
        q_n = q[rows, j]
    rejected = (n < draft_len)[:, None]
    residual = torch.clamp(p_n - q_n, min=0.0)  # after a rejection, sample from max(0, p - q) normalised
    mass = residual.sum(dim=-1, keepdim=True)
    # an empty residual (p <= q everywhere, e.g. p == q) leaves nothing to correct: sample p itself
    fallback = mass <= 0
    residual = torch.where(fallback, p_n, residual / mass.clamp(min=1e-30))
    return sample(torch.where(rejected, residual, p_n))  # all drafts accepted: bonus token from p
