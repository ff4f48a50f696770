"""A trained exit head as vLLM's drafter: the target's first E layers plus the head, run by vLLM's EAGLE proposer.

selfspec's `mlp` head with context "top" reads two states: layer E's at the token, and the final-normed state of
the position before (EAGLE's feature). vLLM's EAGLE proposer hands a draft model exactly those inputs' sources:
the token ids, shifted by one, and the target's final-normed hidden states of the positions before them; for
later draft tokens it feeds back what the draft model returned. So the draft architecture here is

    layer-E state  = the target's layers [0, E) over the token      (vLLM's own Llama / Qwen2 layers, own KV cache)
    estimate       = final_norm(head(layer-E state, previous final state))  (selfspec.heads.MLPHead itself)
    draft logits   = estimate @ lm_head[draft vocabulary].T, -inf elsewhere

and it returns the estimate twice: for the logits, and as the next draft's "previous final state", as
selfspec's own engine does. A `fused` head (EAGLE's draft model at the exit) adds its own decoder layer between
the two: the MLP's output is the layer's input, the layer's change enters scaled by `mix`, and vLLM gives that
layer a KV cache as it gives every draft layer one. The proposer's next pass runs the accepted tokens again with
the target's final states and writes over the drafts' slots: the roll-back selfspec's HeadCache does. The
embedding is the target's (shared by vLLM); the E layers, the final norm, the head and the draft vocabulary's
LM-head rows come from the directory `selfspec export-vllm` writes.

What differs from selfspec's engine: these E layers keep a KV cache of their own (vLLM gives every draft layer
one), and vLLM's EAGLE convention stores the token after each position at that position, so the draft layers
never see a request's first token and see the rest one position early. Rotary attention depends on relative
positions only, so the shift changes nothing; the missing first token lowers agreement a little. Neither changes
what vLLM outputs: its verifier decides every token.

`register()` is the vLLM plugin (entry point group `vllm.general_plugins`): it names the architecture so that
vLLM finds it in every process it starts.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

ARCHITECTURE = "EagleSelfSpecForCausalLM"


def register() -> None:
    """vLLM plugin entry point: make the draft architecture known to vLLM's model registry."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:EagleSelfSpecForCausalLM")


class _Inner(nn.Module):
    """Holds what vLLM's proposer looks for under `model.model`: the embedding it shares, the draft layers."""

    def __init__(self, vllm_config, config, prefix: str, first_layer_id: int, fused: bool):
        super().__init__()
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # attention layers are named after the target's last layer, as vLLM's own EAGLE drafts are: every
        # attention layer of the engine has a name of its own
        self.layers = nn.ModuleList(
            _decoder_layer(vllm_config, config, f"{prefix}.layers.{first_layer_id + i}")
            for i in range(config.selfspec_exit_layer))
        # a fused head's layer, named after the draft layers (per-layer settings: the export's layer_types)
        self.head_layer = (_decoder_layer(vllm_config, config,
                                          f"{prefix}.layers.{first_layer_id + config.selfspec_exit_layer}")
                           if fused else None)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def _decoder_layer(vllm_config, config, prefix: str) -> nn.Module:
    """vLLM's own decoder layer of the target's family (the export's VLLM_FAMILIES)."""
    if config.selfspec_family == "qwen2":  # not model_type: vLLM wraps a draft's config in its EAGLEConfig
        from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer

        return Qwen2DecoderLayer(config, vllm_config.cache_config, vllm_config.quant_config, prefix=prefix)
    from vllm.model_executor.models.llama import LlamaDecoderLayer

    return LlamaDecoderLayer(vllm_config, prefix=prefix, config=config)


def _weights_mapper(family: str):
    """How the family's checkpoint names map onto vLLM's fused modules (q/k/v -> qkv_proj, ...)."""
    if family == "qwen2":
        from vllm.model_executor.models.qwen2 import Qwen2Model

        return Qwen2Model.hf_to_vllm_mapper
    from vllm.model_executor.models.llama import LlamaModel

    return LlamaModel.hf_to_vllm_mapper


class EagleSelfSpecForCausalLM(nn.Module):
    """vLLM draft model of a selfspec head (see the module docstring)."""

    has_own_embed_tokens = False  # vLLM shares the target's embedding in

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.speculative_config.draft_model_config.hf_config
        if "kind" not in getattr(config, "selfspec_head", {}):
            raise ValueError(f"{vllm_config.speculative_config.model} was written by an older `selfspec export-vllm`: "
                             "run it again to rewrite the directory.")
        self.config = config
        dtype = vllm_config.model_config.dtype
        target_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        config.target_layer_count = target_layers  # vLLM's layers index per-layer settings relative to it
        head = config.selfspec_head  # its spec: an `mlp` head reading the previous final state, or a fused one
        fused = head["kind"] == "fused"
        self.model = _Inner(vllm_config, config, f"{prefix}.model" if prefix else "model", target_layers, fused)
        from ..heads import MLPHead

        # the top-reading MLP (a fused head's fusion) is selfspec's own module; no copy scoring
        self.head = MLPHead(head["exit_layer"], config.hidden_size, head["rank"], context="top").to(dtype)
        self.head.requires_grad_(False)
        self.head_mix = (nn.Parameter(torch.zeros(config.hidden_size, dtype=dtype), requires_grad=False)
                         if fused else None)
        draft_vocab = head["draft_vocab_size"] or config.vocab_size
        self.register_buffer("vocab_ids", torch.zeros(draft_vocab, dtype=torch.long), persistent=False)
        self.lm_rows = nn.Parameter(torch.empty(draft_vocab, config.hidden_size, dtype=dtype), requires_grad=False)
        self.vocab_size = config.vocab_size

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) tokens, (N,) positions, (N, H) previous final states -> ((N, H) estimate, the same again)."""
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        layer_e = x if residual is None else x + residual  # the residual stream after layer E
        out = self.head.transform(layer_e, None, hidden_states)
        if self.model.head_layer is not None:  # FusedHead.attend: the layer's change, scaled by mix
            x, residual = self.model.head_layer(positions, out, None)
            out = out + self.head_mix * (x + residual - out)
        estimate = self.model.norm(out)
        return estimate, estimate

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, H) -> (N, V) float logits: the head's draft vocabulary, -inf elsewhere (never drafted)."""
        sub = nn.functional.linear(hidden_states, self.lm_rows).float()  # (N, V_draft)
        full = sub.new_full((hidden_states.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.vocab_ids, sub)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.models.utils import AutoWeightsLoader

        rest = []
        for name, tensor in weights:
            if name == "vocab_ids":
                self.vocab_ids.copy_(tensor)
            else:
                rest.append((name, tensor))
        loaded = AutoWeightsLoader(self).load_weights(rest, mapper=_weights_mapper(self.config.selfspec_family))
        # the embedding is not in the export: vLLM replaces it by the target's after loading
        return set(loaded) | {"vocab_ids", "model.embed_tokens.weight"}
