"""What the engine needs from a decoder-only model, and nothing more.

An adapter reaches the model's own submodules (embedding, decoder layers, rotary embedding, final norm,
LM head); it never copies modeling code, so a transformers release that changes a layer's internals
changes nothing here. Each family overrides the few methods where it differs.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..attention import ENGINE_ATTENTION, ENGINE_CALL

FULL = "full_attention"
SLIDING = "sliding_attention"
SUPPORTED_ATTENTION = ("sdpa", "eager")
# keyword arguments of every decoder-layer call the engine makes: transformers hands them to the attention function
ENGINE_KWARGS = {ENGINE_CALL: True}


class ArchAdapter:
    """Thin view of a causal LM as embed -> layers -> final norm -> LM head."""

    model_types: tuple[str, ...] = ()

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config.get_text_config(decoder=True)
        impl = getattr(self.config, "_attn_implementation", None) or "eager"
        impl = "sdpa" if impl == ENGINE_ATTENTION else impl  # sdpa, with the engine's calls folded (attention.py)
        if impl not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"selfspec needs attn_implementation 'sdpa' or 'eager' (it builds per-row attention masks with "
                f"holes for batched verification); this model uses {impl!r}. Load it with "
                f"attn_implementation='sdpa'."
            )
        self.attn_impl = impl
        # Set only on a decode call's copy (bound): where logits go back to (under an accelerate device map each
        # module leaves its output on its own device), and the call's compiled step (compiled.py), None: eager.
        self.home: torch.device | None = None
        self.compiled = None

    def bound(self, home: torch.device, compiled=None) -> "ArchAdapter":
        """This adapter for one decode call: a copy whose logits return to `home` and whose LM head and exit heads
        run through `compiled` (None: eager). The model's own adapter stays as it is, so calls cannot meet."""
        call = copy.copy(self)
        call.home, call.compiled = home, compiled
        return call

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
        """Decoder layer i on (B, T, H) states; its attention appends to `cache` at its own layer index."""
        return self.call_module(self.layers[i], i, hidden, mask, positions, rotary, cache)

    def call_module(self, layer, i, hidden, mask, positions, rotary, cache) -> torch.Tensor:
        """Call a decoder-layer module (layer i itself, or a head's copy of it) the way layer i is called."""
        raise NotImplementedError

    @property
    def norm(self) -> nn.Module:
        """The final norm module (hooks read its output: the states the LM head reads)."""
        raise NotImplementedError

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)

    def logits(self, normed: torch.Tensor, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """LM head on final-normed states (B, T, H) -> (B, T, V), or only the rows `vocab_ids` -> (B, T, len)."""
        head = self.lm_head
        out = None
        if self.compiled is not None:
            if vocab_ids is None:
                out = self.compiled.logits(self, normed)
            elif not torch.is_grad_enabled() and (rows := _plain_rows(head, vocab_ids)) is not None:
                out = self.compiled.row_logits(rows, normed)
        if out is None:
            out = head(normed) if vocab_ids is None else _head_rows(head, normed, vocab_ids)
        return out if self.home is None else out.to(self.home)

    def cap_logits(self, out: torch.Tensor) -> torch.Tensor:
        """What `logits` does after the LM head's product (Gemma's soft-capping); nothing here."""
        return out

    def device_of_layer(self, i: int) -> torch.device:
        """Where layer i computes (its exit head lives there too)."""
        return execution_device(self.layers[i], f"decoder layer {i}")


def execution_device(module: nn.Module, name: str) -> torch.device:
    """The device a module computes on: its accelerate hook's execution device when dispatched with a
    device_map (offloaded weights sit on 'meta' until the hook loads them), else where its weights are."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", (hook,)):  # a SequentialHook holds several
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device)
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    raise ValueError(
        f"The weights of {name} are on the 'meta' device and no accelerate hook loads them, so it cannot run. "
        f"Load the model with from_pretrained(..., device_map=...) (and offload_folder= for 'disk'), or "
        f"materialise its weights before selfspec.wrap."
    )


def _head_rows(head: nn.Module, normed: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, len(vocab_ids)) from only those rows of the LM head's weight."""
    with _weights_loaded(head):
        weight = head.weight
        if not weight.is_floating_point():
            raise ValueError(
                f"A draft-vocabulary head needs rows of the LM head's weight, but the LM head is quantized "
                f"({type(head).__name__}, {weight.dtype}). Keep lm_head out of quantization (bitsandbytes does by "
                f"default; check llm_int8_skip_modules) or use a head over the full vocabulary."
            )
        rows = vocab_ids.to(weight.device)
        bias = head.bias[rows] if getattr(head, "bias", None) is not None else None
        offloaded = getattr(getattr(head, "_hf_hook", None), "offload", False)  # its weight is loaded per call
        if offloaded:
            return nn.functional.linear(normed.to(weight.device), weight[rows], bias)
        return nn.functional.linear(normed.to(weight.device), _gathered_rows(weight, vocab_ids, rows), bias)


def _plain_rows(head: nn.Module, vocab_ids: torch.Tensor) -> torch.Tensor | None:
    """The LM head's rows `vocab_ids` (len, H), gathered once, where its weight is a plain floating tensor with
    no bias, loaded where it computes (what the compiled step can fold in); None for any other LM head."""
    weight = getattr(head, "weight", None)
    hook = getattr(head, "_hf_hook", None)
    if (not isinstance(weight, torch.Tensor) or type(weight) not in (torch.Tensor, nn.Parameter)
            or not weight.is_floating_point() or weight.device.type == "meta" or hook is not None
            or getattr(head, "bias", None) is not None):
        return None
    return _gathered_rows(weight, vocab_ids, vocab_ids.to(weight.device))


@dataclass
class _Rows:
    """LM-head rows gathered once for one vocab_ids tensor (kept in _ROWS, keyed by that tensor's id)."""

    ids: weakref.ref  # the vocab_ids tensor the entry belongs to
    weight: torch.Tensor  # the LM-head weight the rows came from...
    version: int  # ...at this version of it
    sub: torch.Tensor  # weight[rows]

    def fresh(self, vocab_ids: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.ids() is vocab_ids and self.weight is weight and self.version == weight._version


# id(vocab_ids) -> its _Rows; an entry goes with its vocab_ids tensor. Kept off the tensor itself so that pickling a
# head's buffers never drags the rows along.
_ROWS: dict[int, _Rows] = {}


def _gathered_rows(weight: torch.Tensor, vocab_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """weight[rows], reused between calls: a draft step then reads V_draft x H once instead of gathering the rows
    again (a copy as large as the matmul) for every drafted token. Recomputed when the weight is another tensor or
    was changed in place (its version counter moved)."""
    if (weight.requires_grad and torch.is_grad_enabled()) or weight.device.type == "meta":  # gradients wanted
        return weight[rows]
    key = id(vocab_ids)
    hit = _ROWS.get(key)
    if hit is not None and hit.fresh(vocab_ids, weight):
        return hit.sub
    sub = weight[rows]
    if hit is None or hit.ids() is not vocab_ids:
        weakref.finalize(vocab_ids, _ROWS.pop, key, None)
    _ROWS[key] = _Rows(weakref.ref(vocab_ids), weight, weight._version, sub)
    return sub


def _weights_loaded(module: nn.Module):
    """Context in which an accelerate-offloaded module's weights are real tensors on its execution device."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None or not getattr(hook, "offload", False):
        return contextlib.nullcontext()
    from accelerate.utils import align_module_device

    return align_module_device(module)


def _accepts(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters
