"""`wrap(model)` in place, `unwrap(model)`; the engine lives at `model.selfspec`, outside the module tree."""
from __future__ import annotations

import os
import types

import torch

from .arch import adapter_for
from .cache import SlotTable, SpecCache
from .config import SelfSpecConfig
from .decoding import DecodeSettings, GenerationStats, speculative_decode
from .drafters import build_drafter
from .drafters.base import Drafter
from .forward import StepContext
from .heads import ExitHead
from .hf import wrapped_generate


class SelfSpecEngine:
    """Config, exit heads and the last call's stats of a wrapped model; runs the speculative decode loop."""

    def __init__(self, model, config: SelfSpecConfig, heads: dict[int, ExitHead] | None = None):
        self.model = model
        self.adapter = adapter_for(model)
        self.config = config.validate(self.adapter.num_layers)
        self.heads: dict[int, ExitHead] = dict(heads or {})
        self.drafter_override: Drafter | None = None
        self.draft_model = None  # a separate draft model, for drafter="model"
        self.last_stats: GenerationStats | None = None
        self.last_state = None

    # --- heads and drafters ----------------------------------------------------------------------
    def head_for(self, exit_layer: int) -> ExitHead:
        """The trained head at this layer, or the model's own norm + LM head (no parameters)."""
        if exit_layer not in self.heads:
            return ExitHead(exit_layer)
        return self.heads[exit_layer]

    def add_head(self, head: ExitHead) -> None:
        if not 1 <= head.exit_layer <= self.adapter.num_layers - 1:
            raise ValueError(f"head exit_layer {head.exit_layer} outside [1, {self.adapter.num_layers - 1}].")
        device = self.adapter.device_of_layer(head.exit_layer - 1)
        # heads compute in the LM head's dtype (a bf16 checkpoint runs in fp32 on an fp32 model)
        dtype = self.adapter.lm_head.weight.dtype
        head = head.to(device=device, dtype=dtype) if dtype.is_floating_point else head.to(device)
        self.heads[head.exit_layer] = head.eval()

    def build_drafter(self) -> Drafter:
        """`drafter_override` (a Drafter set by code, e.g. the benchmark's oracle) wins over config.drafter."""
        if self.drafter_override is not None:
            return self.drafter_override
        return build_drafter(self)

    # --- decoding --------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, attention_mask, settings: DecodeSettings):
        """Run speculative decoding; returns (sequences, state) and sets `last_stats`."""
        settings.max_draft_tokens = self.config.max_draft_tokens
        settings.exit_layer = max(1, min(self.config.exit_layer, self.adapter.num_layers - 1))
        drafter = self.build_drafter()
        ctx = StepContext(self.adapter, SpecCache(self.adapter.num_layers),
                          SlotTable(input_ids.shape[0], input_ids.device))
        sequences, state, stats = speculative_decode(ctx, drafter, input_ids, attention_mask, settings)
        self.last_stats, self.last_state = stats, state
        return sequences, state

    def save_pretrained(self, directory: str) -> str:
        """Write only what selfspec adds (config JSON + head weights as safetensors); returns the config path."""
        from .io import save_engine

        return save_engine(self, directory)

    def __repr__(self) -> str:
        return (f"SelfSpecEngine({type(self.model).__name__}, layers={self.adapter.num_layers}, "
                f"config={self.config}, heads={sorted(self.heads)})")


def _resolve_config(config, overrides: dict) -> tuple[SelfSpecConfig, str | None]:
    directory = None
    if config is None:
        config = SelfSpecConfig()
    elif isinstance(config, (str, os.PathLike)):
        directory = str(config)
        config = SelfSpecConfig.load(directory)
    elif isinstance(config, dict):
        config = SelfSpecConfig.from_dict(config)
    elif not isinstance(config, SelfSpecConfig):
        raise TypeError(f"config must be a SelfSpecConfig, a dict or a path, got {type(config).__name__}.")
    known = set(SelfSpecConfig.__dataclass_fields__)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"Unknown selfspec option(s) {unknown}; known options: {sorted(known)}.")
    return (config.replace(**overrides) if overrides else config), directory


def wrap(model, config=None, **overrides):
    """Make `model.generate` self-speculative, in place; returns the model.

    config: a SelfSpecConfig, a dict, or a directory written by `model.selfspec.save_pretrained` (config and
    heads); keyword overrides replace config fields (e.g. exit_layer=8, max_draft_tokens=6).
    drafter: a name ("early_exit", "ngram", "hybrid", "none", ...), a Drafter instance, or a separate draft
    model sharing the tokenizer (classic speculative decoding).
    """
    if getattr(model, "selfspec", None) is not None:
        raise ValueError("This model is already wrapped by selfspec; call selfspec.unwrap(model) first.")
    drafter = overrides.pop("drafter", None)
    if drafter is not None and not isinstance(drafter, str):
        overrides["drafter"] = "model" if hasattr(drafter, "config") else "early_exit"
    elif drafter is not None:
        overrides["drafter"] = drafter
    config, directory = _resolve_config(config, overrides)
    engine = SelfSpecEngine(model, config)
    if isinstance(drafter, Drafter):
        engine.drafter_override = drafter
    elif drafter is not None and not isinstance(drafter, str):
        engine.draft_model = drafter
    if directory is not None:
        from .io import load_heads

        for head in load_heads(directory, engine.adapter):
            engine.add_head(head)
    model.selfspec = engine
    model.generate = types.MethodType(wrapped_generate, model)
    return model


def unwrap(model):
    """Undo `wrap`: the plain model's generate again; returns the model."""
    if getattr(model, "selfspec", None) is None:
        raise ValueError("This model is not wrapped by selfspec.")
    del model.generate
    del model.selfspec
    return model
