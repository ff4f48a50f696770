"""Measure how a draft-vocabulary head should read a tensor-parallel LM head (run by hand, not by pytest):

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 tests/tp_rows_bench.py

For a row-sharded (V, H) LM head and V_draft draft-vocabulary rows, per drafted token: (a) replicated rows, gathered
once (selfspec.heads.dense_rows) and scored on every rank alone; (b) each rank scores the rows it holds and one
all-gather assembles the logits. One-time cost: gathering only the V_draft rows against the whole head
(full_tensor). Prints one line per shape on rank 0.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from selfspec.heads import dense_rows

SHAPES = ((49152, 576, 3580), (49152, 576, 8192), (32000, 2048, 8192))  # (V, H, V_draft); SmolLM2 first


def timed(fn, reps: int = 200) -> float:
    for _ in range(5):
        fn()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    dist.barrier()
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    for v, h, vd in SHAPES:
        torch.manual_seed(0)
        weight = distribute_tensor(torch.randn(v, h), mesh, [Shard(0)])
        ids = torch.randperm(v)[:vd].sort().values
        x = torch.randn(1, 1, h)
        t = time.perf_counter()
        rows = dense_rows(weight, ids)
        rows_s = time.perf_counter() - t
        t = time.perf_counter()
        assert torch.equal(weight.full_tensor()[ids], rows)
        full_s = time.perf_counter() - t
        local, per = weight.to_local(), -(-v // world)
        owner = [(ids >= r * per) & (ids < (r + 1) * per) for r in range(world)]
        mine = local[ids[owner[rank]] - rank * per]
        counts = [int(o.sum()) for o in owner]
        order = torch.cat([o.nonzero().flatten() for o in owner])

        def sharded():
            part = torch.nn.functional.linear(x, mine)
            part = torch.nn.functional.pad(part, (0, max(counts) - part.shape[-1]))
            parts = [torch.empty_like(part) for _ in range(world)]
            dist.all_gather(parts, part)
            cat = torch.cat([p[..., :c] for p, c in zip(parts, counts)], -1)
            return torch.empty_like(cat).index_copy_(-1, order, cat)

        def replicated():
            return torch.nn.functional.linear(x, rows)

        assert torch.allclose(replicated(), sharded(), atol=1e-4)
        rep_ms, shard_ms = timed(replicated), timed(sharded)
        if rank == 0:
            print(f"world {world}, V={v} H={h} V_draft={vd}: one-time gather of the rows {rows_s * 1e3:.1f} ms "
                  f"(whole head {full_s * 1e3:.1f} ms); per drafted token: replicated rows {rep_ms:.3f} ms, "
                  f"sharded rows + all-gather {shard_ms:.3f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
