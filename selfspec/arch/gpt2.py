"""GPT-2: learned absolute positions added to the token embedding, blocks in `transformer.h`, `ln_f`."""
from __future__ import annotations

from .base import ArchAdapter, ENGINE_KWARGS


class GPT2Adapter(ArchAdapter):
    model_types = ("gpt2",)

    def __init__(self, model):
        super().__init__(model)
        self.base = model.transformer

    @property
    def layers(self):
        return self.base.h

    def layer_type(self, i):
        return "full_attention"

    def embed(self, input_ids, positions):
        tokens = self.base.wte(input_ids)
        # a device map may place the two embeddings apart
        return tokens + self.base.wpe(positions.clamp(min=0)).to(tokens.device)

    def call_module(self, layer, i, hidden, mask, positions, rotary, cache):
        return layer(hidden, cache=cache, attention_mask=mask, use_cache=True, position_ids=positions,
                     **ENGINE_KWARGS)

    @property
    def norm(self):
        return self.base.ln_f
