"""A head's drafts over a whole text at once, from the model's hidden states of it (HF's `output_hidden_states`):
every position's first draft, as the decode loop would make it. `train.eval_heads` and the cost model replay
decoding from these."""
from __future__ import annotations

import torch

from .arch.base import ArchAdapter
from .draft_logits import draft_logits
from .heads import ExitHead, previous_top
from .lookup import prefix_copy_candidates


def teacher_forced_logits(head: ExitHead, states, adapter: ArchAdapter, rows: slice) -> torch.Tensor:
    """(N, V_draft) draft logits at `rows` of one text, from HF's hidden states of it (embeddings, each layer's
    output, the last one final-normed): each row drafting the next token; an attention head sees the context
    of a round's first draft (final states before it)."""
    if head.stateful:
        return head.teacher_forced(states[head.exit_layer], states[-1], adapter)[0, rows]
    prev = previous_top(states[-1])[:, rows] if head.reads_top else None
    return head(states[head.exit_layer][:, rows], adapter, prev)[0]


def teacher_forced_candidates(head: ExitHead, text: torch.Tensor, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """(token (N,), match (N,)) a copy head's candidates at `rows` of one text (1, T), each looked up in the text up
    to its row, as the drafter does (-1 and 0 where none), on the text's device."""
    found = prefix_copy_candidates(text[0, : rows.stop].tolist(), head.copy_max)
    token, match = (torch.tensor(c)[rows].to(text.device) for c in found)
    return token, match


def teacher_forced_copy_logits(head: ExitHead, states, adapter: ArchAdapter, text: torch.Tensor,
                               rows: slice, candidates: tuple | None = None) -> torch.Tensor:
    """(N, V) full-vocabulary draft logits of a copy head at `rows` of one text (1, T) from HF's hidden states of
    it, each row a step's first draft, with the candidates looked up in the text up to the row, as the drafter
    does (`candidates`: teacher_forced_candidates' own, when the caller has them already)."""
    if head.stateful:  # a fused head: its first drafts from one pass over the text
        normed = head.normed_out(head.teacher_forced_states(states[head.exit_layer], states[-1], adapter),
                                 adapter)[:, rows]
    else:
        prev = previous_top(states[-1])[:, rows] if head.reads_top else None
        normed = head.normed(states[head.exit_layer][:, rows], adapter, prev)  # (1, N, H)
    token, match = candidates or teacher_forced_candidates(head, text, rows)
    return draft_logits(head, adapter, normed, adapter.vocab_size, token[None].to(normed.device),
                        match[None].to(normed.device))[0]
