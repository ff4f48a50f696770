"""The decode loop's greedy rules replayed over a known answer, for the cost model (calibration) and head
evaluation (selfspec.training.eval_heads): both count what the loop would do from one teacher-forced pass
instead of running it, and both count it with this loop, so that neither restates the rules.

The rules, as decoding.py applies them to a greedy row whose output is known in advance (the plain model's
answer: greedy speculative decoding emits exactly it):
  * prefill emits answer token 0 (one verify step);
  * each later step drafts at most `draft_budget(K, tokens the row may still emit)`, and a chain that copies at
    most `copy_budget(K_copy, ...)` (draft_length.py), never past the answer's end (after an EOS the drafter
    stops; past a cut answer nothing is known);
  * greedy verification accepts drafts up to the first that differs from the verifier's token
    (`accepted_drafts`, sampling.accepted_prefix for one row), and the step emits them plus one token of the
    verifier's own.
tests/test_calibrate.py and tests/test_heads.py compare replays with the real loop's stats.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..draft_length import copy_budget, draft_budget


def accepted_drafts(matches: Sequence[bool]) -> int:
    """Drafts greedy verification accepts, given whether each equals the verifier's token: the leading run of
    matches (sampling.accepted_prefix, on the host for one row)."""
    return next((i for i, ok in enumerate(matches) if not ok), len(matches))


def replay_greedy(answer_len: int, max_new_tokens: int, max_draft_tokens: int,
                  step: Callable[[int, int, int], int], copy_draft_tokens: int = 0) -> int:
    """Verify steps (prefill included) of greedy decoding over an answer of `answer_len` tokens generated with
    `max_new_tokens`. `step(done, k, copy_k)` drafts up to k tokens (a chain that copies: up to copy_k >= k) for
    answer positions done, done + 1, ... (done tokens are emitted so far; the pending one is done - 1) and returns
    how many of them the verifier accepts."""
    steps, done = 1, 1  # the prefill emits answer token 0
    while done < answer_len:
        remaining = max_new_tokens - done
        k = min(draft_budget(max_draft_tokens, remaining), answer_len - done)
        copy_k = min(copy_budget(copy_draft_tokens, k, remaining), answer_len - done)
        accepted = step(done, k, copy_k)
        if not 0 <= accepted <= copy_k:
            raise ValueError(f"a replayed step accepted {accepted} of at most {copy_k} drafts.")
        steps, done = steps + 1, done + accepted + 1
    return steps
