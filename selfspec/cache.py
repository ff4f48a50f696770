"""One KV cache shared by drafter and verifier, rolled back per layer.

The invariant
-------------
Between decoding steps every layer holds KV for exactly the verified prefix (the same number of slots in every
layer). Mid-step the layers are uneven: drafting runs layers [0, E) over the drafted tokens, so those layers are
ahead; verification then runs layers [E, L) over the same positions, starting from the layer-E hidden states the
drafter kept, and the late layers catch up. Nothing is computed twice. After verification every layer is cut back
on its own to the accepted length (`rollback`); `Cache.crop` would cut every layer by the same amount, which is
wrong when the layers differ in length.

Slots and positions
-------------------
A batch shares one slot axis. Rows accept different numbers of tokens per step, so a row's rejected slots stay
allocated as holes (position -1) while another row keeps its accepted tokens in the same slots. `SlotTable`
records the token position held by each (row, slot); attention masks are built from it (masks.py), and every
forward gets explicit positions. Left padding is the same thing: holes at the start.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class SpecLayer(DynamicLayer):
    """KV of one layer in a preallocated buffer (B, heads, capacity, head_dim) that doubles when full.

    `update` writes in place and returns views of the live part, so appending a token is O(1) instead of the
    O(length) `torch.cat` of DynamicLayer, and rolling back is setting `length`.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.length = 0
        self._k = self._v = None
        self.min_capacity = 64  # slots of the first allocation (SpecCache.reserve raises it to a call's need)

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.is_initialized = True

    def _reserve(self, needed: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        capacity = 0 if self._k is None else self._k.shape[-2]
        if needed <= capacity:
            return
        new_cap = max(needed, 2 * capacity, self.min_capacity)
        # zeroed: a compiled pass reads slots past the live ones under a mask (compiled.py), and a masked-out
        # slot must hold no NaN, which a zero weight would carry into the softmax's sum
        k = like_k.new_zeros((*like_k.shape[:-2], new_cap, like_k.shape[-1]))
        v = like_v.new_zeros((*like_v.shape[:-2], new_cap, like_v.shape[-1]))
        if self.length:
            k[..., : self.length, :] = self._k[..., : self.length, :]
            v[..., : self.length, :] = self._v[..., : self.length, :]
        self._k, self._v = k, v

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        self._reserve(self.length + t, key_states, value_states)
        self._k[..., self.length : self.length + t, :] = key_states
        self._v[..., self.length : self.length + t, :] = value_states
        self.length += t
        self._refresh_views()
        return self.keys, self.values

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole (B, heads, capacity, head_dim) K and V buffers, for a pass that writes its slots itself
        (runner.py's compiled pass), or None before the first write allocates them."""
        return None if self._k is None else (self._k, self._v)

    @property
    def capacity(self) -> int:
        """Slots allocated so far (0 before the first write)."""
        return 0 if self._k is None else self._k.shape[-2]

    def advance(self, tokens: int) -> None:
        """Count `tokens` slots written past `length` in place (the compiled step writes the buffer itself)."""
        self.length += tokens
        self._refresh_views()

    def _refresh_views(self):
        if self._k is not None:
            self.keys = self._k[..., : self.length, :]
            self.values = self._v[..., : self.length, :]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int):
        return self.length + query_length, 0

    def truncate(self, length: int) -> None:
        if length < self.length:
            self.length = length
            self._refresh_views()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove; use truncate(length) instead.")
        self.truncate(self.length + tokens_to_remove)

    def allocated_bytes(self) -> int:
        """Bytes of this layer's K and V buffers (their whole capacity, not just the live part)."""
        if self._k is None:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()

    def gather_slots(self, start: int, index: torch.Tensor) -> None:
        """Slots [start, start + D) take the KV of slots start + index (B, D), per row: the accepted path of a
        draft tree moved to the front of its block (gather copies first, so sources and targets may overlap)."""
        if self._k is None or self.length <= start:
            return
        index = index.to(self._k.device)
        d = index.shape[1]
        idx = (start + index)[:, None, :, None].expand(-1, self._k.shape[1], -1, self._k.shape[-1])
        self._k[..., start : start + d, :] = self._k.gather(2, idx)
        self._v[..., start : start + d, :] = self._v.gather(2, idx)

    def reset(self) -> None:
        self.length = 0
        self._k = self._v = None
        self.keys = self.values = None
        self.is_initialized = False

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._k is not None:
            indices = indices.to(self._k.device)  # under a device map each layer's KV sits on its layer's device
            self._k, self._v = self._k[indices], self._v[indices]
            self._refresh_views()


class SpecCache(Cache):
    """A cache of `num_layers` `SpecLayer`s (plus any extra layers a head owns), with per-layer rollback."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[SpecLayer() for _ in range(num_layers)])

    def layer_length(self, i: int) -> int:
        return self.layers[i].length

    def add_layer(self) -> int:
        """Append a layer (for a head with its own attention); returns its index."""
        self.layers.append(SpecLayer())
        return len(self.layers) - 1

    def reserve(self, capacity: int) -> None:
        """Allocate `capacity` slots per layer at the first write: a decode call knows its longest sequence
        (max_length + K + 1), so no layer has to grow and copy its KV in the middle of decoding."""
        for layer in self.layers:
            layer.min_capacity = max(layer.min_capacity, capacity)

    def rollback(self, length: int) -> None:
        """Cut every layer longer than `length` back to `length`: the accepted prefix after verification."""
        for layer in self.layers:
            layer.truncate(length)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    def gather_slots(self, start: int, index: torch.Tensor) -> None:
        """Every layer: slots [start, start + D) take the KV of slots start + index (B, D) (SpecLayer.gather_slots)."""
        for layer in self.layers:
            layer.gather_slots(start, index)

    def select_rows(self, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(rows)


class SlotTable:
    """Token position held by each (row, slot) of the shared cache; -1 marks padding and rejected drafts."""

    def __init__(self, batch: int, device, capacity: int = 256, has_holes: bool | None = None):
        self.pos = torch.full((batch, capacity), -1, dtype=torch.long, device=device)
        # Whether any row may hold a hole (left padding, or rows that accept different numbers of drafts): without
        # one a single query over a dense prefix needs no mask at all. Any batch of two rows or more may.
        self.has_holes = batch > 1 if has_holes is None else has_holes

    @classmethod
    def for_prompt(cls, input_ids: torch.Tensor, attention_mask, capacity: int = 256) -> "SlotTable":
        """The table of a call whose (B, T) prompt has this attention mask (None: no padding), `capacity` slots."""
        padding = attention_mask is not None and bool((attention_mask == 0).any())
        return cls(input_ids.shape[0], input_ids.device, capacity, input_ids.shape[0] > 1 or padding)

    def write(self, start: int, positions: torch.Tensor) -> None:
        """Record (B, T) positions of tokens entering slots [start, start + T)."""
        end = start + positions.shape[1]
        if end > self.pos.shape[1]:
            grown = self.pos.new_full((self.pos.shape[0], max(end, 2 * self.pos.shape[1])), -1)
            grown[:, : self.pos.shape[1]] = self.pos
            self.pos = grown
        self.pos[:, start:end] = positions

    def keep_prefix(self, start: int, keep: torch.Tensor, end: int) -> None:
        """In slots [start, end) row b keeps its first keep[b] slots; the rest become holes."""
        idx = torch.arange(end - start, device=self.pos.device)
        drop = idx[None, :] >= keep[:, None]
        self.pos[:, start:end].masked_fill_(drop, -1)

    def view(self, length: int) -> torch.Tensor:
        return self.pos[:, :length]
