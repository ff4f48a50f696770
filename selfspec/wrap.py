"""`wrap(model)` in place, `unwrap(model)`; the engine lives at `model.selfspec`, outside the module tree."""
from __future__ import annotations

import copy
import dataclasses
import os
import types

import torch
from transformers import PreTrainedModel

from .arch import adapter_for
from .attention import restore_attention, use_engine_attention
from .cache import SlotTable, SpecCache
from .config import SelfSpecConfig, config_file
from .decoding import DecodeSettings, GenerationStats, slot_capacity, speculative_decode
from .drafters import build_drafter
from .drafters.base import Drafter
from .compiled import CompiledStep, compiler_missing, forget, step_for
from .heads import ExitHead
from .hf import warn_once, wrapped_generate
from .io import load_heads, placement, save_engine
from .models import dtype_name
from .runner import Runner


class SelfSpecEngine:
    """Config, exit heads and the last call's stats of a wrapped model; runs the speculative decode loop."""

    def __init__(self, model, config: SelfSpecConfig, heads: dict[int, ExitHead] | None = None):
        self.model = model
        self.adapter = adapter_for(model)
        self.config = config
        self.heads: dict[int, ExitHead] = dict(heads or {})
        self.drafter_override: Drafter | None = None
        self.draft_model = None  # a separate draft model, for drafter="model"
        # tokenizers for the draft model's vocabulary check (given to wrap; a generate call's own take precedence)
        self.tokenizer = None  # the target's
        self.draft_tokenizer = None  # the draft model's, when it is not the target's
        self.call_tokenizers = (None, None)  # a generate call's own, on that call's copy of the engine (for_call)
        # Stats of the last generate call; None when that call ran the plain generate (`last_fallback` says why)
        # or failed, so that stats of an earlier call are never shown as this one's.
        self.last_stats: GenerationStats | None = None
        self.last_fallback: str | None = None
        # Synchronise the device around drafting and verifying so last_stats' per-phase seconds are true on a GPU
        # (the calibrator's cost model reads them); off by default, since every sync stalls the pipeline.
        self.timed = False

    @property
    def config(self) -> SelfSpecConfig:
        return self._config

    @config.setter
    def config(self, config: SelfSpecConfig) -> None:
        """Settings change through here only, checked against this model (SelfSpecConfig.validate): a tool or a user
        assigning `model.selfspec.config = config.replace(...)` gets the same one-line refusal as `wrap`."""
        own = getattr(self, "drafter_override", None)  # a Drafter object given to wrap: its name is a drafter too
        self._config = config.validate(self.adapter.num_layers, None if own is None else own.name)

    # --- heads and drafters ----------------------------------------------------------------------
    def for_call(self, do_sample: bool, tokenizers=None) -> "SelfSpecEngine":
        """What one generate call decodes with: this engine (for_mode), or a shallow copy of it that holds the call's
        own (target, draft) tokenizers; the engine itself is never written by a call."""
        engine = self.for_mode(do_sample)
        if tokenizers is None or all(t is None for t in tokenizers):
            return engine
        engine = copy.copy(engine)
        engine.call_tokenizers = tuple(tokenizers)
        return engine

    def for_mode(self, do_sample: bool) -> "SelfSpecEngine":
        """This engine, or for a sampled call whose config has settings of its own (config.sampling) a shallow copy
        that holds them: the same model, heads and draft model, another config."""
        config = self.config.for_mode(do_sample)
        if config is self.config:
            return self
        engine = copy.copy(self)
        engine.config = config
        return engine

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

    def draft_tokenizers(self) -> tuple:
        """(target tokenizer, draft tokenizer) for the draft model's vocabulary check: those passed to the current
        generate call (`tokenizer=`, `assistant_tokenizer=`) first, else those given to wrap; None where unknown
        (a missing draft tokenizer means the draft model uses the target's)."""
        tok, draft_tok = self.call_tokenizers
        return (tok if tok is not None else self.tokenizer,
                draft_tok if draft_tok is not None else self.draft_tokenizer)

    def call_settings(self, drafter: Drafter, settings: DecodeSettings) -> DecodeSettings:
        """The one place where what a drafter declares on its class (Drafter: uses_early_layers and exit_layer,
        runs_copies, drafts_trees) meets the config: the call's draft length, copy runs, split layer and tree
        shape, each refused or fallen back from in one line where the drafter cannot do what the config asks."""
        trees = self.tree_settings(drafter, settings)
        return dataclasses.replace(settings, max_draft_tokens=self.config.max_draft_tokens,
                                   copy_draft_tokens=self.copy_draft_tokens(drafter, bool(trees)),
                                   exit_layer=self.split_layer(drafter), **trees)

    def split_layer(self, drafter: Drafter) -> int:
        """The layer E where verification switches from layers [0, E) to [E, L).

        A drafter that runs the early layers itself (`uses_early_layers`: early_exit, hybrid) hands the verifier
        its layer-E states, so E is `config.exit_layer` and must lie in [1, L-1]; outside that range it is an error,
        never a clamp (a clamp would verify from another layer than the one the drafter ran to). Every other drafter
        (ngram, a draft model, oracle, none) brings no hidden states and the verifier runs all layers over its
        drafts: E = L (one pass through every layer), whatever `config.exit_layer` says."""
        num_layers = self.adapter.num_layers
        if not drafter.uses_early_layers:
            return num_layers
        exit_layer, name = self.config.exit_layer, drafter.name
        if not isinstance(exit_layer, int) or not 1 <= exit_layer <= num_layers - 1:
            raise ValueError(
                f"exit_layer={exit_layer!r} is out of range for the {name!r} drafter on a model with {num_layers} "
                f"decoder layers: set model.selfspec.config.exit_layer to a value with 1 <= exit_layer <= "
                f"{num_layers - 1} (layers [0, exit_layer) draft, the rest verify).")
        return exit_layer

    def copy_draft_tokens(self, drafter: Drafter, trees: bool) -> int:
        """How far this call's chains may run while they copy (draft_length.copy_budget): the config's, for a drafter
        whose chains copy (`runs_copies`) when it drafts chains; 0 for every other, so that no other draft passes K.
        A config that asks for runs where none can be made says so (a head without a copy lookup: an error; another
        drafter, or trees: once, as a warning), rather than drafting at most K in silence."""
        wanted, k = self.config.copy_draft_tokens, self.config.max_draft_tokens
        if wanted <= k or type(drafter) is Drafter:  # no run past K asked, or nothing drafted at all
            return 0
        missing = drafter.copy_runs_missing()
        if missing:
            raise ValueError(f"copy_draft_tokens={wanted} lets a chain run past K while its head copies, but "
                             f"{missing}, or set copy_draft_tokens=0.")
        if drafter.runs_copies and not trees:
            return wanted
        what = "draft trees" if trees else f"the {drafter.name!r} drafter"
        warn_once(f"selfspec: copy_draft_tokens={wanted} lets the chains of a copy head and of the hybrid run past "
                  f"K while they copy; {what} draft at most max_draft_tokens={k}.", stacklevel=5)
        return 0

    def tree_settings(self, drafter: Drafter, settings: DecodeSettings) -> dict:
        """The tree shape this call drafts with: the config's, or a chain (with a one-time warning) where a tree
        cannot run: a drafter that drafts chains only, or logits processors that read the prefix (a tree node's
        prefix is its branch, which those processors cannot be shown). The drafter that drafts nothing (plain
        decoding through the engine, as the calibrator's and bench's baselines run) has no shape to fall back
        from, so it is not warned about."""
        top_k = self.config.draft_tree_top_k
        if top_k == 1 or type(drafter) is Drafter:
            return {}
        if not drafter.drafts_trees:
            reason = f"the {drafter.name!r} drafter drafts chains only"
        elif not settings.processors.prefix_free:
            reason = ("a logits processor reads the prefix (" + ", ".join(type(p).__name__ for p in
                      settings.processors.processors) + "), which differs from branch to branch of a tree")
        else:
            return {"tree_top_k": top_k, "tree_size": self.config.draft_tree_size}
        warn_once(f"selfspec: {reason}; drafting chains instead of trees (draft_tree_top_k={top_k}).", stacklevel=4)
        return {}

    # --- decoding --------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, attention_mask, settings: DecodeSettings, tokenizers=None):
        """Run speculative decoding; returns (sequences, state) and sets `last_stats`.

        `settings` is not modified: the engine decodes with a copy carrying its own draft length and split layer
        (`split_layer`). `tokenizers`: (target, draft) tokenizers of this call, for the draft model's vocabulary
        check."""
        self.last_stats = None  # a call that fails leaves no stats of an earlier one behind
        engine = self.for_call(settings.do_sample, tokenizers)
        drafter = engine.build_drafter()
        settings = engine.call_settings(drafter, settings)
        compiled = self.compiled_step(input_ids.device)
        if compiled is not None:
            self.fit_compiled(compiled, settings)
        slots = SlotTable.for_prompt(input_ids, attention_mask, slot_capacity(settings, *input_ids.shape))
        runner = Runner(self.adapter, SpecCache(self.adapter.num_layers), slots, compiled)
        sequences, state, stats = speculative_decode(runner, drafter, input_ids, attention_mask, settings)
        self.last_stats = stats  # the state (and its KV cache) goes back to the caller only, never kept here
        return sequences, state

    def compiled_step(self, device: torch.device) -> CompiledStep | None:
        """The engine's compiled passes when its config asks for them (kept across calls), else None; where no
        compiler can run, one line says so and decoding runs eager."""
        if not self.config.compile:
            return None
        missing = compiler_missing(device)
        if missing:
            warn_once(f"selfspec: compile=True, but {missing}; decoding runs eager.", stacklevel=5)
            return None
        return step_for(self.model, device)

    @staticmethod
    def fit_compiled(compiled: CompiledStep, settings: DecodeSettings) -> None:
        """The full verify passes of a call's chains and trees run at their own size (CompiledStep.fit)."""
        compiled.fit(settings.max_draft_tokens + 1, settings.copy_draft_tokens + 1,
                     settings.tree_size + 1 if settings.tree_top_k > 1 else 0)

    def warmup(self, batch_sizes=(1,), max_length: int = 2048, progress: bool = True) -> float:
        """With compile=True, compile every pass shape this config makes for these batch sizes now, so that no
        request compiles anything (warmup.py); returns the seconds it took (0 when decoding runs eager)."""
        from .warmup import warm_up

        return warm_up(self, batch_sizes, max_length, progress)

    def reset_compiled(self) -> None:
        """Drop the compiled graphs (they hold the weights as compiled): the next call compiles anew."""
        forget(self.model)

    def save_pretrained(self, directory: str) -> str:
        """Write only what selfspec adds (config JSON + head weights as safetensors); returns the config path."""
        return save_engine(self, directory)

    def __repr__(self) -> str:
        return (f"SelfSpecEngine({type(self.model).__name__}, layers={self.adapter.num_layers}, "
                f"config={self.config}, heads={sorted(self.heads)})")


# What `wrap(model)` drafts with when it is given no heads, no drafter and no exit layer: an untrained exit drafts
# badly and pays for E layers and the LM head per draft (on SmolLM2 a fifth of plain speed), while a prompt lookup
# costs nothing to draft and is right wherever the answer repeats its context.
UNTRAINED_DEFAULT = {"drafter": "ngram", "max_draft_tokens": 8}
NO_HEADS_NOTE = ("selfspec: no trained exit heads were given, so drafts come from n-gram lookups in the prompt and "
                 "text so far; heads trained for this model (docs/training.md) draft with its early layers too.")


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


def calibration_mismatch(config: SelfSpecConfig, model) -> str | None:
    """Why a calibrated config's speed may not hold for this model, or None: the calibration timed its settings in
    another dtype or on another kind of device (the shipped SmolLM2 config, timed in bfloat16 on an AVX512-BF16
    CPU, decodes at 0.92x of plain generate in float32 on an AVX2-only one: docs/benchmarks.md)."""
    calibration = config.metadata.get("calibration") or {}
    dtype, device = calibration.get("dtype"), calibration.get("device")
    if config.drafter == "none" or dtype is None or device is None:
        return None
    here = placement(model)
    if (dtype, torch.device(device).type) == (here["dtype"], here["device"]):
        return None
    env = calibration.get("environment") or {}
    machine = f" ({env['cpu']}, {env['cores']} cores)" if env.get("cpu") and env.get("cores") else ""
    return (f"this config's settings were timed in {dtype_name(dtype)} on {device}{machine}, and this model runs in "
            f"{dtype_name(here['dtype'])} on {here['device']}, where they may decode slower than plain generate; "
            f"`selfspec calibrate --model NAME_OR_PATH --output DIR` times them on this machine (and writes a config "
            f"that drafts nothing where drafting does not pay), then wrap with DIR.")


def wrap(model, config=None, **overrides):
    """Make `model.generate` self-speculative, in place; returns the model.

    config: a SelfSpecConfig, a dict, or a directory written by `model.selfspec.save_pretrained` (config and
    heads); keyword overrides replace config fields (e.g. exit_layer=8, max_draft_tokens=6).
    drafter: a name ("early_exit", "ngram", "hybrid", "none", ...), a Drafter instance, or a separate draft
    model sharing the tokenizer (classic speculative decoding). A Drafter instance runs as given; the config
    records its `name` (and, for a drafter that exits at a layer of its own, that `exit_layer`), and
    `save_pretrained` refuses a config that would not rebuild it.
    tokenizer, draft_tokenizer: the target's and the draft model's tokenizers, for the draft model's vocabulary
    check (same tokenizer, embeddings padded to different row counts); `generate(..., tokenizer=,
    assistant_tokenizer=)` may pass them per call instead.
    """
    if getattr(model, "selfspec", None) is not None:
        raise ValueError("This model is already wrapped by selfspec; call selfspec.unwrap(model) first.")
    drafter = overrides.pop("drafter", None)
    tokenizer = overrides.pop("tokenizer", None)
    draft_tokenizer = overrides.pop("draft_tokenizer", None)
    unknown_name = None  # the name of a Drafter object that the config does not know
    if isinstance(drafter, Drafter):
        overrides.update(_drafter_object_fields(drafter, overrides))
        if not _config_knows(overrides["drafter"]):
            unknown_name = overrides["drafter"]
            # validated as the kind of drafter it is (does it need a valid exit layer?), named after validation
            overrides["drafter"] = "early_exit" if drafter.uses_early_layers else "none"
    elif drafter is not None and not isinstance(drafter, str):
        if not isinstance(drafter, PreTrainedModel):
            raise TypeError(f"drafter must be a drafter name, a Drafter object or a causal LM to draft with, got "
                            f"{type(drafter).__name__}.")
        overrides["drafter"] = "model"
    elif drafter is not None:
        overrides["drafter"] = drafter
    if config is None and drafter is None and "exit_layer" not in overrides:
        overrides = {**UNTRAINED_DEFAULT, **overrides}
        warn_once(NO_HEADS_NOTE, stacklevel=3)
    config, directory = _resolve_config(config, overrides)
    mismatch = calibration_mismatch(config, model)
    if mismatch:
        warn_once(f"selfspec: {mismatch}", stacklevel=3)
    try:
        engine = SelfSpecEngine(model, config)
    except ValueError as err:
        if directory is None or overrides:
            raise
        # a value the config file holds, out of range for this model: say which file
        raise ValueError(f"{config_file(directory)}: {err} Fix: change it in that file, or override it: "
                         f"selfspec.wrap(model, DIR, name=value).") from err
    if isinstance(drafter, Drafter):
        engine.drafter_override = drafter
    elif drafter is not None and not isinstance(drafter, str):
        engine.draft_model = drafter
    if unknown_name is not None:
        engine.config = engine.config.replace(drafter=unknown_name)
    engine.tokenizer, engine.draft_tokenizer = tokenizer, draft_tokenizer
    if directory is not None:
        for head in load_heads(directory, engine.adapter):
            engine.add_head(head)
    model.selfspec = engine
    model.generate = types.MethodType(wrapped_generate, model)
    use_engine_attention(model)
    return model


def _drafter_object_fields(drafter: Drafter, overrides: dict) -> dict:
    """Config fields that describe a Drafter object: its name, and the layer it exits at if it drafts with the
    early layers (the verifier must start from that layer; a conflicting exit_layer is refused)."""
    name = drafter.name
    if not isinstance(name, str) or not name:
        raise TypeError(f"{type(drafter).__name__} needs a `name` (a class attribute naming the drafter).")
    fields = {"drafter": name}
    layer = drafter.exit_layer
    if drafter.uses_early_layers and isinstance(layer, int):
        given = overrides.get("exit_layer")
        if given is not None and given != layer:
            raise ValueError(f"The {type(drafter).__name__} exits at layer {layer}, but exit_layer={given} was given: "
                             f"verification must start from the drafter's own layer. Drop exit_layer, or build the "
                             f"drafter for layer {given}.")
        fields["exit_layer"] = layer
    return fields


def _config_knows(name: str) -> bool:
    """Whether SelfSpecConfig accepts `name` as its drafter."""
    try:
        SelfSpecConfig(drafter=name).validate()
    except ValueError:
        return False
    return True


def unwrap(model):
    """Undo `wrap`: the plain model's generate again; returns the model."""
    if getattr(model, "selfspec", None) is None:
        raise ValueError("This model is not wrapped by selfspec.")
    del model.generate
    del model.selfspec
    restore_attention(model)
    return model
