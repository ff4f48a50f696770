"""What the engine needs from a decoder-only model, and nothing more.

An adapter reaches the model's own submodules (embedding, decoder layers, rotary embedding, final norm,
LM head); it never copies modeling code, so a transformers release that changes a layer's internals
changes nothing here. Each family overrides the few methods where it differs.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

FULL = "full_attention"
SLIDING = "sliding_attention"
SUPPORTED_ATTENTION = ("sdpa", "eager")


class ArchAdapter:
    """Thin view of a causal LM as embed -> layers -> final norm -> LM head."""

    model_types: tuple[str, ...] = ()

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config.get_text_config(decoder=True)
        impl = getattr(self.config, "_attn_implementation", None) or "eager"
        if impl not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"selfspec needs attn_implementation 'sdpa' or 'eager' (it builds per-row attention masks with "
                f"holes for batched verification); this model uses {impl!r}. Load it with "
                f"attn_implementation='sdpa'."
            )
        self.attn_impl = impl

    # --- structure -------------------------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        raise NotImplementedError

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def layer_type(self, i: int) -> str:
        """'full_attention' or 'sliding_attention' for layer i."""
        types = getattr(self.config, "layer_types", None)
        if types:
            return SLIDING if types[i] == SLIDING else FULL
        return SLIDING if getattr(self.config, "sliding_window", None) else FULL

    def window(self, i: int) -> int | None:
        return self.config.sliding_window if self.layer_type(i) == SLIDING else None

    # --- computation -----------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, H) input of layer 0."""
        raise NotImplementedError

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict | None:
        """Position embeddings per layer type for (B, T) positions, or None for absolute-position models."""
        return None

    def call_layer(self, i, hidden, mask, positions, rotary, cache) -> torch.Tensor:
        raise NotImplementedError

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, normed: torch.Tensor, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """LM head on final-normed states (B, T, H) -> (B, T, V), or only the rows `vocab_ids` -> (B, T, len)."""
        head = self.lm_head
        if vocab_ids is None:
            return head(normed)
        weight = head.weight[vocab_ids]
        bias = head.bias[vocab_ids] if getattr(head, "bias", None) is not None else None
        return nn.functional.linear(normed, weight, bias)

    def device_of_layer(self, i: int) -> torch.device:
        return next(self.layers[i].parameters()).device


def _accepts(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters
