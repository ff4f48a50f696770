"""The runner: every pass of a decode call over its shared cache, eager or compiled, through one function.

    runner = Runner(adapter, cache, slots, compiled)         # one per decode call (and one per draft model)
    hidden, positions = runner.prompt(ids, mask, exit_layer)  # the prompt through layers [0, E)
    normed = runner.remainder(hidden, positions, exit_layer)  # layers [E, L) + the final norm: (B, T, H)
    logits = runner.adapter.logits(normed)                    # the LM head, back on the ids' device

`layer_range` is the one implementation of a pass over decoder layers [start, stop). Eager, it runs on the cache
itself (each layer appends its KV); compiled, torch.compile wraps the same function over the cache's preallocated
buffers, written at slot indices (`slot_layer_range`; compiled.py keeps the graphs and their shapes). Which of the
two runs, the tree mask and the device logits go back to are arguments, or fixed when the runner is made: nothing
is set on a shared object during a call.
"""
from __future__ import annotations

import torch

from .arch.base import ArchAdapter
from .cache import SlotTable, SpecCache
from .compiled import CompiledStep, dense, padded, padded_mask
from .masks import build_mask, needs_mask


def layer_range(adapter: ArchAdapter, start: int, stop: int, hidden, positions, masks: dict, cache):
    """Decoder layers [start, stop) on (B, T, H) states at (B, T) positions -> (B, T, H); masks {window: (B, 1, T,
    S) mask or None}; each layer's KV goes to `cache` (the SpecCache, or a _SlotWriter over its buffers)."""
    rotary = adapter.rotary(hidden, positions)
    quiet = _OUTPUT_COLLECTOR.set(None) if _OUTPUT_COLLECTOR is not None else None
    for i in range(start, stop):
        hidden = adapter.call_layer(i, hidden, masks[adapter.window(i)], positions, rotary, cache)
    if _OUTPUT_COLLECTOR is not None:
        _OUTPUT_COLLECTOR.reset(quiet)
    return hidden


def slot_layer_range(adapter: ArchAdapter, start: int, stop: int, hidden, positions, masks: dict, slots, keys,
                     values):
    """`layer_range` over preallocated KV buffers, the function torch.compile wraps: the (B, Tb) tokens' KV goes to
    `slots` (Tb,) of each layer's buffer in keys/values, read up to the masks' S slots."""
    length = next(iter(masks.values())).shape[-1]
    return layer_range(adapter, start, stop, hidden, positions, masks, _SlotWriter(keys, values, slots, length, start))


def slot_own_pass(fn, adapter: ArchAdapter, module, positions, mask, slots, key, value, *states):
    """`fn` (a drafter's own pass, Runner.run_own) over one preallocated KV buffer, the function torch.compile wraps:
    the (B, Tb) tokens' KV goes to `slots` (Tb,) of `key`/`value`, read up to the mask's S slots."""
    writer = _SlotWriter([key], [value], slots, mask.shape[-1], 0)
    return fn(adapter, module, positions, mask, writer, *states)


class _SlotWriter:
    """The cache a compiled pass hands the model's layers: `update` writes the new KV at the pass's slots (a tensor,
    so no length is a Python number the compiler would specialise on) and returns the layer's buffer up to `length`."""

    def __init__(self, keys, values, slots, length: int, first: int):
        self.keys, self.values, self.slots, self.length, self.first = keys, values, slots, length, first

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx - self.first], self.values[layer_idx - self.first]
        k.index_copy_(2, self.slots, key_states)
        v.index_copy_(2, self.slots, value_states)
        return k[:, :, : self.length], v[:, :, : self.length]


def _output_collector():
    """transformers' output-capturing hooks, installed on a model's layers the first time it is asked for hidden
    states or attentions, read their collector from a ContextVar, which Dynamo cannot trace: the graph would break
    in the layer loop and the whole pass would run eager. Set inside a compiled function, the collector becomes a
    plain global (transformers' CompileableContextVar, as its own compiled forward uses it); the engine's passes
    collect nothing, so it is set to None there and reset after."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without output-capturing hooks
        return None
    return _active_collector if hasattr(_active_collector, "reset") else None


_OUTPUT_COLLECTOR = _output_collector()

# a draft tree's mask while its nodes are among a pass's queries: (first slot of the tree, (B, M, M) ancestors)
Tree = tuple[int, torch.Tensor]


class Runner:
    """The passes of one decode call over one shared cache and slot table.

    `adapter` is the model's adapter bound to this call (ArchAdapter.bound): its logits return to the slot table's
    device, and the LM head and exit heads run through `compiled` when it is given. Passes of a size `compiled`
    has a graph shape for, over cache layers whose buffers have room, run compiled; every other pass (the prompt,
    a pass past the largest shape) runs the same `layer_range` eager."""

    def __init__(self, adapter: ArchAdapter, cache: SpecCache, slots: SlotTable, compiled: CompiledStep | None = None):
        self.model_adapter = adapter  # the engine's own, never changed: compiled graphs guard on it
        self.adapter = adapter.bound(slots.pos.device, compiled)
        self.cache, self.slots, self.compiled = cache, slots, compiled

    def verified_len(self) -> int:
        """Slots of the verified prefix: the last layer's length (a host int)."""
        return self.cache.layer_length(self.adapter.num_layers - 1)

    def run(self, start: int, stop: int, hidden, positions, slot_positions=None, tree: Tree | None = None):
        """Decoder layers [start, stop) on (B, T, H) states at (B, T) positions, appending to the cache.

        Tokens enter the slot table when they enter layer 0; `slot_positions` (B, T) overrides what is recorded
        there (-1 for padding). `tree`: the mask of a draft tree whose nodes are among the queries."""
        if start >= stop:
            return hidden
        q_start, t = self.cache.layer_length(start), hidden.shape[1]
        if start == 0:
            self.slots.write(q_start, positions if slot_positions is None else slot_positions)
        if self._compiles(start, stop, q_start, t):
            return self._compiled_pass(start, stop, hidden, positions, q_start, tree)
        live = self.slots.view(q_start + t)
        masks = self._per_window(start, stop, lambda window: self._mask(live, positions, q_start, window, hidden.dtype,
                                                                         tree))
        return layer_range(self.model_adapter, start, stop, hidden, positions, masks, self.cache)

    def _windows(self, start: int, stop: int) -> list:
        """The attention windows of layers [start, stop), each once."""
        return list(dict.fromkeys(map(self.adapter.window, range(start, stop))))

    def _per_window(self, start: int, stop: int, mask_for) -> dict:
        """{window: mask_for(window)} for the attention windows of layers [start, stop), each built once."""
        return {window: mask_for(window) for window in self._windows(start, stop)}

    def _mask(self, live, positions, q_start: int, window, dtype, tree: Tree | None):
        """The (B, 1, T, S) mask of the (B, T) queries from slot q_start over the live slots (B, S) under one
        attention window, or None where the attention implementation's own causal rule is the same."""
        impl = self.adapter.attn_impl
        if not needs_mask(self.slots.has_holes, positions.shape[1], q_start, window, impl, tree):
            return None
        return build_mask(live, positions, q_start, window, dtype, impl, tree)

    def early(self, input_ids, positions, exit_layer: int, slot_positions=None, tree: Tree | None = None):
        """Embed (B, T) tokens and run layers [0, exit_layer): their (B, T, H) layer-E states."""
        hidden = self.adapter.embed(input_ids, positions)
        return self.run(0, exit_layer, hidden, positions, slot_positions, tree)

    def prompt(self, input_ids, attention_mask, layers: int):
        """A left-padded (B, T) prompt through layers [0, layers): each row's positions count its real tokens from 0,
        and its padding enters the slot table as holes (slot position -1) that no token attends to. The one
        statement of how a prompt enters a cache (the verifier's prefill, a draft model's). Returns the layer
        output and the (B, T) positions."""
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return self.early(input_ids, positions, layers, positions.masked_fill(mask == 0, -1)), positions

    def remainder(self, hidden, positions, exit_layer: int, tree: Tree | None = None):
        """Layers [exit_layer, L) on layer-E states (B, T, H), then the final norm: (B, T, H) final-normed states."""
        hidden = self.run(exit_layer, self.adapter.num_layers, hidden, positions, tree=tree)
        return self.adapter.final_norm(hidden)

    def own_cache(self) -> SpecCache:
        """A one-layer cache for a drafter's own module (a head's layer), its slots mirroring the shared cache's and
        its buffer allocated at the same size, so that its passes compile as the shared layers' do."""
        cache = SpecCache(1)
        cache.reserve(self.cache.layers[0].min_capacity)
        return cache

    def run_own(self, fn, module, like: int, cache: SpecCache, positions, *states, tree: Tree | None = None):
        """A pass of a drafter's own module: `fn(adapter, module, positions, mask, cache, *states)` on (B, T, H)
        `states` at (B, T) positions, where `module` holds a copy of decoder layer `like` whose KV goes to layer 0 of
        its own `cache` (own_cache). The masks (holes, padding, layer `like`'s window, a tree) come from the shared
        slot table. Compiled where a graph shape fits and the module's weights are as compiled, else eager: the
        same `fn` either way (heads.fused_pass, heads.layer_pass)."""
        q_start, t = cache.layer_length(0), positions.shape[1]
        number = self._compiled_module(module, cache, q_start, t)
        if number is not None:
            return self._compiled_own(fn, module, number, like, cache, positions, states, q_start, tree)
        live = self.slots.view(q_start + t)
        mask = self._mask(live, positions, q_start, self.adapter.window(like), states[0].dtype, tree)
        return fn(self.adapter, module, positions, mask, cache, *states)

    # --- the compiled pass ---------------------------------------------------------------------------------------
    def _compiles(self, start: int, stop: int, q_start: int, tokens: int) -> bool:
        """Whether a pass of `tokens` tokens over layers [start, stop) runs compiled: a graph shape fits it, and each
        layer's buffer is allocated with room for the padded pass (the prompt allocates them)."""
        return self.compiled is not None and self._has_room(self.cache.layers[start:stop], q_start, tokens)

    def _has_room(self, layers, q_start: int, tokens: int) -> bool:
        """Whether a graph shape fits a pass of `tokens` tokens and each of `layers` holds exactly q_start slots in
        a buffer with room for the padded pass."""
        tb, _ = self.compiled.size(tokens)
        return tb is not None and all(layer.capacity > q_start + tb and layer.length == q_start for layer in layers)

    def _compiled_pass(self, start: int, stop: int, hidden, positions, q_start: int, tree: Tree | None):
        """`run` through the compiled `slot_layer_range`: pad the T tokens to the pass's Tb rows, build the masks
        over the buffer's read length, run, record the new lengths, return the T real rows."""
        step, adapter = self.compiled, self.model_adapter
        b, t, _ = hidden.shape
        tb, key = step.size(t)
        layers = self.cache.layers[start:stop]
        masks, positions, slots = self._padded_inputs(layers, self._windows(start, stop), positions, q_start,
                                                      hidden.dtype, tree)
        hidden = padded(hidden, tb)
        step.mark_tokens((hidden, 1))
        keys, values = zip(*(layer.buffers() for layer in layers))
        out = step.call(slot_layer_range, ("layers", start, stop, b, key), adapter, start, stop, hidden, positions,
                        masks, slots, list(keys), list(values))
        return self._written(layers, out, t)

    def _compiled_module(self, module, cache: SpecCache, q_start: int, tokens: int):
        """The compiled step's number for `module` where a pass of `tokens` tokens of it into `cache` runs compiled
        (a shape fits, its buffer has room, its weights are as compiled), else None."""
        if self.compiled is None or not self.compiled.runs(tokens) or not self._has_room(cache.layers, q_start, tokens):
            return None
        return self.compiled.module_number(module)

    def _compiled_own(self, fn, module, number, like: int, cache: SpecCache, positions, states, q_start: int,
                      tree: Tree | None):
        """`run_own` through the compiled `slot_own_pass`, padded and masked as `_compiled_pass` does a layer range."""
        step = self.compiled
        b, t = positions.shape
        tb, key = step.size(t)
        masks, positions, slots = self._padded_inputs(cache.layers, [self.adapter.window(like)], positions, q_start,
                                                      states[0].dtype, tree)
        states = [padded(s, tb) for s in states]
        step.mark_tokens(*((s, 1) for s in states))
        k, v = cache.layers[0].buffers()
        out = step.call(slot_own_pass, ("own", fn.__name__, number, b, key), fn, self.model_adapter, module,
                        positions, next(iter(masks.values())), slots, k, v, *states)
        return self._written(cache.layers, out, t)

    def _padded_inputs(self, layers, windows, positions, q_start: int, dtype, tree: Tree | None):
        """What a compiled pass of the (B, T) positions' tokens into `layers` from slot q_start is handed, each
        padded to the pass's Tb rows: {window: (B, 1, Tb, S) mask over the buffers' read length}, the (B, Tb)
        positions and the (Tb,) slots they write. The masks and the layers' buffers are marked for the compiler."""
        step, impl = self.compiled, self.model_adapter.attn_impl
        b, t = positions.shape
        tb, _ = step.size(t)
        length = layers[0].capacity - 1 if step.cuda else q_start + tb
        live = self.slots.view(q_start + t)
        masks = {window: padded_mask(build_mask(live, positions, q_start, window, dtype, "sdpa", tree), q_start, t, tb,
                                     length, dtype, impl) for window in windows}
        step.mark_cache(list(masks.values()), tuple(buffer for layer in layers for buffer in layer.buffers()))
        if tb > t:  # a padding row sits at the last real position (its mask lets it see only its own slot)
            positions = torch.cat([positions, positions[:, -1:].expand(b, tb - t)], dim=1)
        positions = dense(positions)
        slots = torch.arange(q_start, q_start + tb, device=positions.device)
        step.mark_tokens((positions, 1), (slots, 0), *((mask, 2) for mask in masks.values()))
        return masks, positions, slots

    def _written(self, layers, out, t: int):
        """After a compiled pass: count its T tokens in `layers`, return the T real rows of its padded output."""
        for layer in layers:
            layer.advance(t)
        self.compiled.announce()
        return self.compiled.real_rows(out, t)
