"""Whole weights from a tensor-parallel model's shards (weights that are DTensors, sharded over the ranks of a
torchrun job), for what runs replicated beside it: an exit head's draft-vocabulary rows of the LM head, an attention
head's copy of a decoder layer."""
from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from .distributed import is_dtensor

# Heads are replicated: every rank holds all of a head and computes it alone, so drafting adds no collective per drafted token. The
# draft-vocabulary rows of a sharded LM head are gathered once (only those rows: 38 ms against 234 ms for the whole
# head) and cached. Measured on CPU/gloo, 2 ranks: scoring SmolLM2's 3580 draft rows
# (H = 576) from replicated rows took 0.15 ms per drafted token against 1.6 ms for each rank scoring the rows it
# holds plus an all-gather of the logits; at H = 2048 with 8192 rows the two were even (5.1 against 4.8 ms).
# Every function here that gathers is a collective: all ranks call it together, as the decode loop does.


def dense_rows(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """weight[rows] as a plain tensor. For a DTensor sharded by rows (an LM head under a tensor-parallel plan),
    each rank contributes the requested rows it holds and one all-gather assembles them; other layouts gather the
    whole tensor. Collective for a DTensor: every rank of its mesh must call it with the same rows."""
    if not is_dtensor(weight):
        return weight[rows.to(weight.device)]
    from torch.distributed.tensor import Shard

    weight = weight.detach()
    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements[0] != Shard(0):
        return weight.full_tensor()[rows.to(weight.to_local().device)]
    local = weight.to_local()
    rows = rows.to(local.device).long()
    group, world = mesh.get_group(), mesh.size()
    sizes = [torch.zeros(1, dtype=torch.long, device=local.device) for _ in range(world)]
    torch.distributed.all_gather(sizes, torch.tensor([local.shape[0]], device=local.device), group=group)
    bounds = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long, device=local.device), *sizes]), 0).tolist()
    owned = [(rows >= bounds[r]) & (rows < bounds[r + 1]) for r in range(world)]
    width = max(int(m.sum()) for m in owned)
    me = mesh.get_local_rank()
    mine = local[rows[owned[me]] - bounds[me]]
    padded = torch.zeros(width, *local.shape[1:], dtype=local.dtype, device=local.device)
    padded[: mine.shape[0]] = mine
    parts = [torch.empty_like(padded) for _ in range(world)]
    torch.distributed.all_gather(parts, padded, group=group)
    out = torch.empty(len(rows), *local.shape[1:], dtype=local.dtype, device=local.device)
    for r in range(world):
        out[owned[r]] = parts[r][: int(owned[r].sum())]
    return out


# id(vocab_ids) -> (weakref to vocab_ids, LM-head weight, its version, rows, bias rows): gathered once per draft
# vocabulary and LM head, dropped with the vocab_ids tensor, regathered if the weight changes
_TP_ROWS: dict[int, tuple] = {}


def replicated_rows(head: nn.Module, vocab_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = head.weight
    key = id(vocab_ids)
    hit = _TP_ROWS.get(key)
    if hit is not None and hit[0]() is vocab_ids and hit[1] is weight and hit[2] == weight._version:
        return hit[3], hit[4]
    rows = dense_rows(weight, vocab_ids)
    bias = getattr(head, "bias", None)
    bias = None if bias is None else dense_rows(bias, vocab_ids)
    if hit is None or hit[0]() is not vocab_ids:
        weakref.finalize(vocab_ids, _TP_ROWS.pop, key, None)
    _TP_ROWS[key] = (weakref.ref(vocab_ids), weight, weight._version, rows, bias)
    return rows, bias


def whole_copy(layer: nn.Module) -> nn.Module:
    """A copy of a decoder layer for an attention head. On a tensor-parallel model the copy gets whole (gathered)
    weights and loses the tensor-parallel forward wrappers, so the head runs alone on every rank (replicated);
    otherwise it is a plain deep copy. Collective on a tensor-parallel model (one gather per sharded weight)."""
    whole = {id(p): nn.Parameter(p.detach().full_tensor(), requires_grad=p.requires_grad)
             for p in layer.parameters() if is_dtensor(p)}
    if not whole:
        return copy.deepcopy(layer)
    out = copy.deepcopy(layer, memo=dict(whole))
    for module in out.modules():
        module.__dict__.pop("forward", None)  # transformers installs the sharded forward on the instance
        module.__dict__.pop("_is_hooked", None)
    return out
