"""The drafter interface: `propose(state, k) -> Draft`, then `accepted(state, n)` after verification."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Draft:
    tokens: torch.Tensor  # (B, k) proposed tokens; columns past a row's draft_len are ignored
    draft_len: torch.Tensor  # (B,) tokens each row proposes, <= k
    q: torch.Tensor | None = None  # (B, k, V) processed draft probabilities; None for point-mass drafts
    # (B, m, H) layer-E states of the first m verify inputs (pending token, then drafts), already run through
    # layers [0, E) into the shared cache; verification runs [0, E) only for inputs m..k.
    hidden: torch.Tensor | None = None
    # the layer E whose input `hidden` is; the loop refuses states from any layer but the one it verifies from
    hidden_layer: int | None = None

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def empty(batch: int, device) -> "Draft":
        return Draft(torch.empty(batch, 0, dtype=torch.long, device=device),
                     torch.zeros(batch, dtype=torch.long, device=device))


class Drafter:
    """Proposes tokens for the verifier. Subclasses override `propose`; `begin`/`accepted` are hooks for drafters
    with state of their own (a draft model's cache, a head's attention cache).

    A drafter only proposes: the loop writes the proposed tokens into the sequence, masks rows that have
    finished and checks that hidden states come from the layer it verifies from (decoding.take_draft). A drafter
    may still write its drafts early (state.write_draft) so that logits processors reading the prefix see them
    while it drafts the next one; nothing else relies on that."""

    name = "none"
    uses_early_layers = False
    # Whether `begin` reads state.prompt_hidden, the (B, T0, H) layer-E and final states of the prompt; the loop
    # keeps them through prefill only for drafters that say so.
    needs_prompt_hidden = False

    def begin(self, state) -> None:
        """Called once after prefill."""

    def propose(self, state, k: int) -> Draft:
        return Draft.empty(state.batch, state.device)

    def accepted(self, state, draft: Draft, n: torch.Tensor) -> None:
        """Called after verification and rollback; n (B,) drafts accepted per row."""
