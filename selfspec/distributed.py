"""Keeping the ranks of a tensor-parallel job in step.

Under tensor parallelism (`from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))` inside
`torchrun`) every rank runs the same decode loop on the same tokens; each holds a shard of the weights, and the
model's own collectives make the logits identical on every rank. So greedy decisions agree by construction, and
sampled ones agree when every rank's generator is seeded identically (`torch.manual_seed(seed)` on every rank)
and consumed identically, which the loop does.

The loop passes every decision (accepted drafts `n`, the verifier's token) through `agree_across_ranks`: rank 0's
decision is the one used, and if any rank's own decision differs from it (an unseeded or differently seeded
generator, different inputs, non-deterministic kernels at a near-tie) every rank raises the same RuntimeError
naming the first such rank and the decode step. Decoding on after a disagreement would be silent garbage: the
ranks would feed different tokens into one sharded forward pass.

Drafts are not broadcast: the drafter runs on every rank from the same replicated hidden states (and, when
sampling, the same generator state), so they are identical, and a broadcast per drafted token would add K
collectives to every step. A divergent draft is caught instead: a rejected one cannot change the output (its
cache slots are rolled back); a divergent accepted one always changes `n` in greedy decoding (two different drafts
cannot both equal the argmax of logits every rank shares), and when sampling changes `n` or the token unless the
ranks' generators happen to agree on both. A caller that passes the drafts makes the check exact for accepted
drafts (a checksum of them joins the all-gather).

Single-process runs (torch.distributed not initialized, or one rank) take no collective and no device sync.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

WORLD = "world"  # default group: every rank of the job

_group = WORLD
_step = 0


def is_dtensor(tensor) -> bool:
    """True for a torch.distributed.tensor.DTensor (a sharded or replicated tensor-parallel weight)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def is_tensor_parallel(model: nn.Module) -> bool:
    """True when any parameter of `model` is a DTensor (loaded with a tensor-parallel plan)."""
    return any(is_dtensor(p) for p in model.parameters())


def tensor_parallel_group(model: nn.Module):
    """The process group over which `model`'s weights are sharded, or None for a model without DTensor weights."""
    for p in model.parameters():
        if is_dtensor(p):
            mesh = p.device_mesh
            return mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")
    return None


def set_group(group) -> None:
    """Set the ranks that must decide together: a process group (e.g. `tensor_parallel_group(model)` when the job
    runs several tensor-parallel groups side by side), `WORLD` (the default: every rank of the job), or None
    (no agreement: each rank decodes its own prompts with a whole model, i.e. data-parallel generation)."""
    global _group
    _group = group


def _active_group(group):
    if group is WORLD or group == WORLD:
        group = None  # torch's default group
    elif group is None:
        return False, None
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False, None
    return torch.distributed.get_world_size(group) > 1, group


def _next_step(step: int | None) -> int:
    """The decode step of this decision: 0 for the first token after prefill, then one per verify step. Callers
    may pass it; otherwise it is counted here, starting over when the loop's prefill path (_decode_steps) calls."""
    global _step
    if step is not None:
        _step = step
    elif sys._getframe(2).f_code.co_name == "_decode_steps":
        _step = 0
    else:
        _step += 1
    return _step


def _comm_device(tensor: torch.Tensor, group) -> torch.device:
    backend = str(torch.distributed.get_backend(group))
    if tensor.device.type == "cpu" and backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if tensor.device.type != "cpu" and backend == "gloo":
        return torch.device("cpu")
    return tensor.device  # "cpu:gloo,cuda:nccl" and the like route by device themselves


def _drafts_checksum(drafts: torch.Tensor | None, n: torch.Tensor) -> torch.Tensor:
    """(B,) checksum of each row's accepted drafts (the first n of (B, k)); zeros without drafts."""
    if drafts is None or drafts.shape[1] == 0:
        return torch.zeros_like(n)
    k = drafts.shape[1]
    weights = torch.randint(1, 2**31 - 1, (k,), generator=torch.Generator().manual_seed(17)).to(drafts.device)
    accepted = torch.arange(k, device=drafts.device)[None, :] < n[:, None]
    return ((drafts.long() + 1) * accepted * weights).sum(1)


def agree_across_ranks(n: torch.Tensor, token: torch.Tensor, drafts: torch.Tensor | None = None, *,
                       group=None, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) accepted counts and (B,) verifier tokens of this rank -> the values every rank must use (rank 0's).

    drafts: optional (B, k) drafted tokens, so that the check covers accepted drafts exactly.
    group: the ranks that decide together; default: the one set by `set_group` (every rank of the job).
    step: the decode step, for the error message; counted here when not given.
    Single-process runs return n and token unchanged, with no collective call and no device sync. Raises
    RuntimeError on every rank when any rank's own decision differs from rank 0's."""
    active, pg = _active_group(_group if group is None else group)
    if not active:
        return n, token
    step = _next_step(step)
    device = _comm_device(n, pg)
    mine = torch.stack([n.long(), token.long(), _drafts_checksum(drafts, n.long())]).to(device)  # (3, B)
    gathered = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(pg))]
    torch.distributed.all_gather(gathered, mine, group=pg)
    ref = gathered[0]
    for rank, theirs in enumerate(gathered[1:], start=1):
        if not torch.equal(theirs, ref):
            raise RuntimeError(_disagreement(rank, step, ref.cpu(), theirs.cpu(), pg))
    return n, token


def _disagreement(rank: int, step: int, ref: torch.Tensor, theirs: torch.Tensor, group) -> str:
    row = int((ref != theirs).any(0).nonzero()[0])
    global_rank = torch.distributed.get_global_rank(group, rank) if group is not None else rank
    if torch.equal(ref[:2, row], theirs[:2, row]):
        what = f"rank {global_rank}'s accepted drafts differ from rank 0's"
    else:
        what = (f"rank {global_rank} decided n={int(theirs[0, row])}, token={int(theirs[1, row])} where rank 0 "
                f"decided n={int(ref[0, row])}, token={int(ref[1, row])}")
    return (f"Tensor-parallel ranks disagree at decode step {step} (0 = first token after prefill), batch row {row}: "
            f"{what}; seed every rank identically (torch.manual_seed(seed) on every rank before generate) and give "
            f"every rank the same inputs (ranks that each decode their own prompts with a whole model: call "
            f"selfspec.distributed.set_group(None)).")
