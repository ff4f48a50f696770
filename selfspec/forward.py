"""Split forward: `forward_early` runs layers [0, E), `forward_remainder` runs layers [E, L) + final norm.

Both take explicit (B, T) positions and write into the shared cache (cache.py), each layer group at its own
current length. Masks are built once per call and layer type from the slot table.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .arch.base import ArchAdapter
from .cache import SlotTable, SpecCache
from .compiled import CompiledStep
from .masks import build_mask, needs_mask


@dataclass
class StepContext:
    """What a forward needs besides the tokens: the model view, the shared cache and its slot table."""

    adapter: ArchAdapter
    cache: SpecCache
    slots: SlotTable
    compiled: CompiledStep | None = None  # the engine's compiled passes (compiled.py), None: eager

    def __post_init__(self):
        # the slot table lives with the token ids; logits return there from wherever the LM head runs
        self.adapter.home = self.slots.pos.device
        self.adapter.compiled = self.compiled


@dataclass
class EarlyResult:
    hidden: torch.Tensor  # (B, T, H): output of layer E-1, input of layer E


@dataclass
class RemainderResult:
    hidden: torch.Tensor  # (B, T, H): final-normed last-layer states

    def logits(self, adapter: ArchAdapter, last_only: bool = False) -> torch.Tensor:
        h = self.hidden[:, -1:] if last_only else self.hidden
        return adapter.logits(h)


def run_layers(ctx: StepContext, hidden, positions, start: int, stop: int, slot_positions=None) -> torch.Tensor:
    """Run decoder layers [start, stop) on (B, T, H) states at (B, T) positions, appending to the cache.

    New tokens enter the slot table when they enter layer 0; `slot_positions` (B, T) overrides what is
    recorded there (-1 for padding). With a compiled step, passes of its shapes run there (compiled.py)."""
    if start >= stop:
        return hidden
    if ctx.compiled is not None and ctx.compiled.can_run(ctx.cache, start, stop, hidden.shape[1]):
        return ctx.compiled.run_layers(ctx, hidden, positions, start, stop, slot_positions)
    adapter = ctx.adapter
    q_start = ctx.cache.layer_length(start)
    t = hidden.shape[1]
    if start == 0:
        ctx.slots.write(q_start, positions if slot_positions is None else slot_positions)
    slot_pos = ctx.slots.view(q_start + t)
    rotary = adapter.rotary(hidden, positions)
    masks = {}
    for i in range(start, stop):
        window = adapter.window(i)
        if window not in masks:
            masks[window] = (
                build_mask(slot_pos, positions, q_start, window, hidden.dtype, adapter.attn_impl, ctx.slots.tree)
                if needs_mask(ctx.slots.has_holes, t, q_start, window, adapter.attn_impl, ctx.slots.tree)
                else None
            )
        hidden = adapter.call_layer(i, hidden, masks[window], positions, rotary, ctx.cache)
    return hidden


def forward_early(ctx: StepContext, input_ids, positions, exit_layer: int, slot_positions=None) -> EarlyResult:
    """Embed (B, T) tokens and run layers [0, exit_layer)."""
    hidden = ctx.adapter.embed(input_ids, positions)
    return EarlyResult(run_layers(ctx, hidden, positions, 0, exit_layer, slot_positions))


def forward_prompt(ctx: StepContext, input_ids, attention_mask, layers: int) -> tuple[EarlyResult, torch.Tensor]:
    """Run a left-padded (B, T) prompt through layers [0, layers): each row's positions count its real tokens from
    0, and its padding enters the slot table as holes (slot position -1) that no token attends to. The one
    statement of how a prompt enters a cache (the verifier's prefill, a draft model's). Returns the layer output
    and the (B, T) positions."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    ctx.slots.has_holes = input_ids.shape[0] > 1 or bool((mask == 0).any())
    return forward_early(ctx, input_ids, positions, layers, positions.masked_fill(mask == 0, -1)), positions


def forward_remainder(ctx: StepContext, hidden, positions, exit_layer: int) -> RemainderResult:
    """Run layers [exit_layer, L) on layer-E states (B, T, H), then the final norm."""
    hidden = run_layers(ctx, hidden, positions, exit_layer, ctx.adapter.num_layers)
    return RemainderResult(ctx.adapter.final_norm(hidden))


def forward_full(ctx: StepContext, input_ids, positions) -> RemainderResult:
    return forward_remainder(ctx, forward_early(ctx, input_ids, positions, 0).hidden, positions, 0)


def run_module(ctx: StepContext, layer, i: int, cache: SpecCache, hidden, positions) -> torch.Tensor:
    """Run one extra decoder-layer module (a head's copy of layer i) on (B, T, H) states at (B, T) positions.

    Its KV goes to layer 0 of its own `cache`, whose slots stay aligned with the shared cache's slot table, so
    the masks (holes, padding, sliding window of layer i) come from the same table."""
    adapter = ctx.adapter
    q_start, t = cache.layer_length(0), hidden.shape[1]
    window = adapter.window(i)
    mask = None
    tree = ctx.slots.tree
    if needs_mask(ctx.slots.has_holes, t, q_start, window, adapter.attn_impl, tree):
        mask = build_mask(ctx.slots.view(q_start + t), positions, q_start, window, hidden.dtype, adapter.attn_impl,
                          tree)
    return adapter.call_module(layer, i, hidden, mask, positions, adapter.rotary(hidden, positions), cache)
