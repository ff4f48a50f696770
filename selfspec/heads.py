"""Exit heads: map layer-E hidden states (B, T, H) to draft logits (B, T, V_draft).

A head may score only a subset of the vocabulary (`vocab_ids`, (V_draft,) ids into the full vocabulary);
the engine then drafts only tokens of that subset, with q = 0 elsewhere, which keeps verification exact.
Heads share the model's final norm and LM head through the adapter and never register them as their own
parameters, so saving a head writes only what it adds.
"""
from __future__ import annotations

import torch
from torch import nn

from .arch.base import ArchAdapter


class ExitHead(nn.Module):
    """Base: the model's own final norm + LM head applied at layer E (LayerSkip's exit; no parameters)."""

    kind = "norm"

    def __init__(self, exit_layer: int, vocab_ids: torch.Tensor | None = None):
        super().__init__()
        self.exit_layer = exit_layer
        self.register_buffer("vocab_ids", None if vocab_ids is None else vocab_ids.long(), persistent=True)

    def transform(self, hidden: torch.Tensor, adapter: ArchAdapter) -> torch.Tensor:
        """Residual-stream adapter before the shared norm; identity for the plain exit."""
        return hidden

    def forward(self, hidden: torch.Tensor, adapter: ArchAdapter) -> torch.Tensor:
        h = self.transform(hidden, adapter)
        return adapter.logits(adapter.final_norm(h), self.vocab_ids)

    def spec(self) -> dict:
        """JSON-able description from which `build_head` rebuilds the module before loading weights."""
        return {"kind": self.kind, "exit_layer": self.exit_layer,
                "draft_vocab_size": None if self.vocab_ids is None else int(self.vocab_ids.numel())}

    def reset_state(self, batch: int) -> None:
        """Heads with their own cache clear it here at the start of each generate call."""


HEAD_KINDS: dict[str, type[ExitHead]] = {"norm": ExitHead}


def register_head(cls: type[ExitHead]) -> type[ExitHead]:
    HEAD_KINDS[cls.kind] = cls
    return cls


def build_head(spec: dict, adapter: ArchAdapter) -> ExitHead:
    kind = spec.get("kind", "norm")
    if kind not in HEAD_KINDS:
        raise ValueError(f"Unknown exit head kind {kind!r}; known kinds: {sorted(HEAD_KINDS)}.")
    return HEAD_KINDS[kind].from_spec(spec, adapter) if hasattr(HEAD_KINDS[kind], "from_spec") else \
        HEAD_KINDS[kind](spec["exit_layer"], _vocab_placeholder(spec))


def _vocab_placeholder(spec: dict) -> torch.Tensor | None:
    # the real ids arrive with load_state_dict; the buffer only needs the right shape
    size = spec.get("draft_vocab_size")
    return None if size is None else torch.zeros(size, dtype=torch.long)
