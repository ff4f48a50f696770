"""Pick the adapter for a model by its `model_type`, or say clearly which families are supported."""
from __future__ import annotations

from .base import ArchAdapter
from .gemma import GemmaAdapter
from .gpt2 import GPT2Adapter
from .gpt_neox import GPTNeoXAdapter
from .llama import LlamaAdapter

ADAPTERS = (LlamaAdapter, GemmaAdapter, GPT2Adapter, GPTNeoXAdapter)
FAMILIES = {
    "Llama family": LlamaAdapter.model_types,
    "Gemma family": GemmaAdapter.model_types,
    "GPT-2": GPT2Adapter.model_types,
    "GPT-NeoX": GPTNeoXAdapter.model_types,
}


def supported_model_types() -> list[str]:
    return sorted(t for cls in ADAPTERS for t in cls.model_types)


def adapter_for(model) -> ArchAdapter:
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"selfspec.wrap expects a transformers PreTrainedModel, got {type(model).__name__}.")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"selfspec supports decoder-only causal LMs; {type(model).__name__} is an encoder-decoder model."
        )
    model_type = config.get_text_config(decoder=True).model_type
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            if model.get_output_embeddings() is None:
                break
            return cls(model)
    families = "; ".join(f"{name}: {', '.join(types)}" for name, types in FAMILIES.items())
    raise ValueError(
        f"selfspec does not support model_type {model_type!r} ({type(model).__name__}). It needs a causal LM "
        f"(a *ForCausalLM class with an LM head) of a supported family: {families}."
    )
