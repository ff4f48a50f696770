"""Draft with the model's own layers [0, E) plus an exit head, writing layers [0, E) of the shared cache."""
from __future__ import annotations

import torch

from ..forward import forward_early
from ..heads import ExitHead
from ..sampling import logits_to_probs, sample
from .base import Draft, Drafter


class EarlyExitDrafter(Drafter):
    name = "early_exit"
    uses_early_layers = True

    def __init__(self, head: ExitHead, confidence_threshold: float = 0.0):
        self.head = head
        self.exit_layer = head.exit_layer
        self.threshold = confidence_threshold

    def head_logits(self, state, hidden: torch.Tensor) -> torch.Tensor:
        """(B, 1, H) layer-E state -> (B, V) draft logits over the full vocabulary (-inf outside the head's)."""
        sub = self.head(hidden, state.adapter)[:, -1].float()
        if self.head.vocab_ids is None:
            return sub
        full = sub.new_full((sub.shape[0], state.vocab_size), float("-inf"))
        return full.index_copy_(1, self.head.vocab_ids.to(sub.device), sub)

    def propose(self, state, k: int) -> Draft:
        if k == 0:
            return Draft.empty(state.batch, state.device)
        x = state.pending
        active = ~state.finished
        draft_len = torch.zeros_like(state.pending)
        hiddens, tokens, qs = [], [], []
        for j in range(k):
            h = forward_early(state.ctx, x[:, None], state.pos[:, None] + j, self.exit_layer).hidden
            hiddens.append(h)
            logits = state.process(self.head_logits(state, h)[:, None], offset=j)[:, 0]  # (B, V)
            probs = logits_to_probs(logits)
            token = sample(probs) if state.do_sample else logits.argmax(dim=-1)
            confident = probs.max(dim=-1).values >= self.threshold
            take = active & confident
            draft_len += take.long()
            active = take & ~state.is_eos(token)  # nothing is drafted after an EOS
            tokens.append(token)
            if state.do_sample:
                qs.append(probs)
            state.write_draft(j, token)
            if j + 1 < k and not bool(active.any()):
                break
            x = token
        width = int(draft_len.max())
        return Draft(
            tokens=torch.stack(tokens[:width], dim=1) if width else tokens[0][:, None][:, :0],
            draft_len=draft_len,
            q=torch.stack(qs[:width], dim=1) if (qs and width) else None,
            hidden=torch.cat(hiddens[: width + 1], dim=1),
        )
