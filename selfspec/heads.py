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


@register_head
class MLPHead(ExitHead):
    """Residual MLP adapter before the shared norm + LM head: h + down(silu(up(rmsnorm(h)))).

    `down` starts at zero, so an untrained MLP head is exactly the plain exit (design 1) and training can only
    move away from it where that helps.
    """

    kind = "mlp"

    def __init__(self, exit_layer: int, hidden_size: int, rank: int | None = None,
                 vocab_ids: torch.Tensor | None = None, eps: float = 1e-6):
        super().__init__(exit_layer, vocab_ids)
        self.hidden_size, self.rank = hidden_size, rank or 2 * hidden_size
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.up = nn.Linear(hidden_size, self.rank, bias=False)
        self.down = nn.Linear(self.rank, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)

    def transform(self, hidden, adapter):
        x = self.norm(hidden.to(self.up.weight.dtype))
        return hidden + self.down(nn.functional.silu(self.up(x))).to(hidden.dtype)

    def spec(self) -> dict:
        return {**super().spec(), "hidden_size": self.hidden_size, "rank": self.rank}

    @classmethod
    def from_spec(cls, spec: dict, adapter: ArchAdapter) -> "MLPHead":
        if spec["hidden_size"] != adapter.hidden_size:
            raise ValueError(f"MLP head for hidden size {spec['hidden_size']}, model has {adapter.hidden_size}.")
        return cls(spec["exit_layer"], spec["hidden_size"], spec["rank"], _vocab_placeholder(spec))


def frequent_token_ids(token_ids: torch.Tensor, size: int, always: list[int] | None = None) -> torch.Tensor:
    """The `size` most frequent ids of a (N,) token stream, plus `always` (e.g. EOS), sorted: a draft vocabulary."""
    counts = torch.bincount(token_ids.flatten().long())
    top = torch.argsort(counts, descending=True)[:size]
    top = top[counts[top] > 0]
    ids = torch.unique(torch.cat([top, torch.tensor(always or [], dtype=torch.long)]))
    return ids
