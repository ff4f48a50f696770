"""How many tokens a step may draft: the loop's rules of draft length, stated once. The loop (decoding.py) applies
the budgets, the early-exit chain the per-draft rule, and the replays of the loop (tools/replay.py, the cost model,
head evaluation) import the same functions instead of restating them.

Two budgets a step:
  * k = draft_budget(K, tokens left): at most K drafts, one fewer than the tokens a row may still emit, since the
    verifier adds one token of its own;
  * copy_budget(K_copy, k, tokens left) >= k: how far a chain may run past k while it copies. Text that copies
    (a translation quoting names, a summary quoting its source, code edited in place) runs long and is drafted
    right far more often than free text, so one K cannot suit both; the chain's first k drafts are judged by its
    confidence rule, and each further one only by whether it copies (`copies`, `chain_may_draft`). A prompt-lookup
    continuation copies by the same measure, its match: the hybrid drafts one of 2+ tokens to copy_k
    (`lookup_budget`).
"""
from __future__ import annotations

COPY_MIN_MATCH = 2  # a draft copies when it is its copy head's candidate for a match of this many tokens or more


def draft_budget(max_draft_tokens: int, remaining: int) -> int:
    """Drafts to propose this step: at most K, and one fewer than the tokens left, since the verifier always
    adds one token of its own."""
    return max(0, min(max_draft_tokens, remaining - 1))


def copy_budget(copy_draft_tokens: int, k: int, remaining: int) -> int:
    """Most drafts a chain may propose this step while it copies, given the step's budget k (draft_budget):
    copy_draft_tokens within the tokens left, never fewer than k (0: no run past k)."""
    return max(k, draft_budget(copy_draft_tokens, remaining))


def copies(token, candidate, match):
    """Whether drafts `token` are their copy head's candidates (`candidate`, -1 where none) for a match of
    COPY_MIN_MATCH or more tokens (`match`): (B,) tensors, or ints."""
    return (token == candidate) & (match >= COPY_MIN_MATCH)


def chain_may_draft(j: int, k: int, confident, copying):
    """Whether a chain proposes its draft j (0-based) in a step whose budget is k: one of its first k as its
    confidence rule judges it (`confident`), one past them only if it copies (`copying`); copy_budget bounds j.
    Tensors (per row) or bools."""
    return confident if j < k else copying


def lookup_budget(k: int, copy_k: int, match):
    """How many tokens of a prompt-lookup continuation a row may draft, given its match length `match` ((B,) tensor
    or int): copy_k where the match is long enough to count as a copy, else k (copy_k = copy_budget >= k)."""
    return (match >= COPY_MIN_MATCH) * (copy_k - k) + k
