"""Attention masks from slot positions: causal in token positions, holes masked, optional sliding window."""
from __future__ import annotations

import torch


def build_mask(slot_pos, q_pos, q_start, window, dtype, impl, tree=None):
    """Mask of shape (B, 1, T, S) for T queries entering slots [q_start, q_start + T) of S = q_start + T slots.

    slot_pos: (B, S) token position per slot, -1 for holes; q_pos: (B, T) positions of the queries.
    A query sees valid slots at positions <= its own (and within `window` positions, if given). It always sees
    its own slot too, so a padding query (a row of holes) gets a finite softmax instead of NaN.
    sdpa takes the boolean mask; eager adds a float mask of 0 / dtype-min.
    tree: (start, ancestors) while a draft tree occupies slots [start, start + M) and the queries are among them:
    there a query sees only its own ancestors, ancestors (B, M, M) bool (trees.tree_ancestors), since nodes of
    other branches share its positions.
    """
    t = q_pos.shape[1]
    keys = slot_pos[:, None, :]  # (B, 1, S)
    queries = q_pos[:, :, None]  # (B, T, 1)
    allowed = (keys >= 0) & (keys <= queries)
    if window is not None:
        allowed &= queries - keys < window
    own = torch.arange(slot_pos.shape[1], device=slot_pos.device)[None, :] == (
        q_start + torch.arange(t, device=slot_pos.device)
    )[:, None]
    allowed = allowed | own[None]
    if tree is not None:
        start, ancestors = tree
        s = slot_pos.shape[1]
        allowed[:, :, start:] &= ancestors[:, q_start - start : q_start - start + t, : s - start]
    allowed = allowed.unsqueeze(1)
    if impl == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )


def needs_mask(has_holes: bool, t: int, q_start: int, window: int | None, impl: str, tree=None) -> bool:
    """Whether T queries entering slots [q_start, q_start + T) need an explicit mask.

    None suffices when nothing beyond plain causality would be masked (no holes, prefix within the window) and
    either there is one query (it sees every slot) or the queries start the cache under sdpa, whose own causal
    mask (is_causal, aligned to the top left) is then exactly right. This spares a prefill the (B, 1, T, T) mask."""
    if has_holes or tree is not None or (window is not None and q_start + t > window):
        return True
    return not (t == 1 or (q_start == 0 and impl == "sdpa"))
