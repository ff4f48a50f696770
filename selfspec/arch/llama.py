"""Llama family: Llama, Mistral, Mixtral, Qwen2, Qwen3, Phi-3 and everything with `model.model.{embed_tokens,
layers, norm, rotary_emb}` and decoder layers called as `layer(h, attention_mask=, position_embeddings=,
position_ids=, cache=, use_cache=)`."""
from __future__ import annotations

import torch

from .base import ArchAdapter, ENGINE_KWARGS, FULL, SLIDING, _accepts


class LlamaAdapter(ArchAdapter):
    model_types = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "olmo2",
                   "smollm3")

    def __init__(self, model):
        super().__init__(model)
        self.base = model.model
        # Gemma 3 keeps one rotary table per layer type (local layers use another base frequency).
        self._rotary_by_type = _accepts(self.base.rotary_emb.forward, "layer_type")

    @property
    def layers(self):
        return self.base.layers

    def embed(self, input_ids, positions):
        return self.base.embed_tokens(input_ids)

    def rotary(self, hidden, positions):
        if self._rotary_by_type:
            types = {self.layer_type_name(i) for i in range(self.num_layers)}
            return {t: self.base.rotary_emb(hidden, positions, t) for t in types}
        table = self.base.rotary_emb(hidden, positions)
        return {FULL: table, SLIDING: table}

    def layer_type_name(self, i: int) -> str:
        types = getattr(self.config, "layer_types", None)
        return types[i] if types else self.layer_type(i)

    def call_module(self, layer, i, hidden, mask, positions, rotary, cache):
        return layer(
            hidden,
            attention_mask=mask,
            position_embeddings=rotary[self.layer_type_name(i)],
            position_ids=positions,
            cache=cache,
            use_cache=True,
            **ENGINE_KWARGS,
        )

    @property
    def norm(self):
        return self.base.norm
