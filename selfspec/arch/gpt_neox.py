"""GPT-NeoX (Pythia): `gpt_neox.{embed_in, layers, final_layer_norm, rotary_emb}`; the layer takes the cache
as `layer_past=`."""
from __future__ import annotations

from .base import ArchAdapter, ENGINE_KWARGS


class GPTNeoXAdapter(ArchAdapter):
    model_types = ("gpt_neox",)

    def __init__(self, model):
        super().__init__(model)
        self.base = model.gpt_neox

    @property
    def layers(self):
        return self.base.layers

    def layer_type(self, i):
        return "full_attention"

    def embed(self, input_ids, positions):
        return self.base.embed_in(input_ids)

    def rotary(self, hidden, positions):
        return self.base.rotary_emb(hidden, positions)

    def call_module(self, layer, i, hidden, mask, positions, rotary, cache):
        return layer(
            hidden, attention_mask=mask, position_ids=positions, layer_past=cache, use_cache=True,
            position_embeddings=rotary, **ENGINE_KWARGS,
        )

    @property
    def norm(self):
        return self.base.final_layer_norm
