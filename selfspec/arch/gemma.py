"""Gemma family: Gemma, Gemma 2, Gemma 3 (text). Llama's layout plus a scaled embedding (inside the embedding
module in transformers 5), sliding-window layers, per-layer-type rotary tables (Gemma 3) and final logit
soft-capping (Gemma 2/3)."""
from __future__ import annotations

import torch

from .llama import LlamaAdapter


class GemmaAdapter(LlamaAdapter):
    model_types = ("gemma", "gemma2", "gemma3_text")

    def __init__(self, model):
        super().__init__(model)
        self.softcap = getattr(self.config, "final_logit_softcapping", None)

    def logits(self, normed, vocab_ids=None):
        return self.cap_logits(super().logits(normed, vocab_ids))

    def cap_logits(self, out):
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out
