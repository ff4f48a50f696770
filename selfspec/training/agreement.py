"""Baseline for exit heads: how often the *untrained* exit at layer E agrees with the full model.

    python -m train.agreement --config configs/smollm2-135m.yaml [--cache-dir DIR] [--seq-stride K] [--json OUT]

For every exit layer stored by ``train.collect``, the untrained exit is the model's own final
norm + LM head applied to ``hidden.E`` (the residual stream entering layer E). Over the rows
that predict a response token (response positions and the last prompt position), it reports:

- ``top1``: argmax of the exit == argmax of the full model (``teacher_top1``, exact fp32);
  the per-token acceptance rate of greedy self-speculative decoding with this exit;
- ``top5``: the full model's argmax is within the exit's top 5;
- ``accept``: sum_v min(p_exit(v), p_full(v)) at temperature 1, the per-token acceptance
  probability of speculative *sampling* with this exit as the draft;
- ``run``: mean number of consecutive agreeing tokens starting at each position, capped at 8
  (how many greedy drafts a block would accept, if drafting up to 8).

Split by chain kind (greedy chain 0 vs sampled chains), plus all rows.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from selfspec.training.shards import load_config, load_model, model_fingerprint

RUN_CAP = 8


def _runs(agree: torch.Tensor, seq_id: torch.Tensor, cap: int = RUN_CAP) -> torch.Tensor:
    """For each row, the length of the run of agreeing rows starting there, within its sequence."""
    a, sid = agree.tolist(), seq_id.tolist()
    run = [0] * (len(a) + 1)
    for i in range(len(a) - 1, -1, -1):
        nxt = run[i + 1] if i + 1 < len(a) and sid[i + 1] == sid[i] else 0
        run[i] = (1 + nxt) if a[i] else 0
    return torch.tensor(run[:len(a)]).clamp(max=cap)


@torch.no_grad()
def shard_stats(model, t: dict, layers: list[int], chunk: int, seq_stride: int = 1) -> dict:
    """Per-layer sums over the response-predicting rows of one shard (every ``seq_stride``-th sequence)."""
    off = t["seq_offsets"]
    n_seq = off.numel() - 1
    seq_id = torch.repeat_interleave(torch.arange(n_seq), off.diff())
    last_prompt = t["positions"] == torch.repeat_interleave(t["seq_prompt_len"] - 1, off.diff())
    keep = (t["is_response"].bool() | last_prompt) & (t["target_ids"] >= 0) & (seq_id % seq_stride == 0)
    rows = keep.nonzero().squeeze(1)
    chain = t["seq_chain"][seq_id[rows]]  # 0: greedy answer, > 0: sampled, -1: dataset text (teacher-forced)
    sampled, greedy = chain > 0, chain == 0
    norm, head = model.model.norm, model.get_output_embeddings()
    dtype = head.weight.dtype  # the model's own dtype: stored states go in as the model computes (bf16 by default)
    teacher = t["teacher_top1"][rows].long()
    n = rows.numel()
    top1 = {e: torch.empty(n, dtype=torch.bool) for e in layers}
    top5 = {e: torch.empty(n, dtype=torch.bool) for e in layers}
    acc = {e: torch.empty(n, dtype=torch.float32) for e in layers}
    for s in range(0, n, chunk):
        sl = slice(s, s + chunk)
        r = rows[sl]
        p = head(t["hidden.final"][r].to(dtype)).float().softmax(-1)  # full model, once per chunk
        for e in layers:
            q = head(norm(t[f"hidden.{e}"][r].to(dtype))).float()
            top1[e][sl] = q.argmax(-1) == teacher[sl]
            top5[e][sl] = (q.topk(5, dim=-1).indices == teacher[sl, None]).any(-1)
            acc[e][sl] = torch.minimum(q.softmax(-1), p).sum(-1)
    out = {}
    for e in layers:
        # runs are measured over consecutive kept rows of the same sequence
        run = _runs(top1[e], seq_id[rows]).float()
        out[e] = {}
        for split, m in (("all", torch.ones_like(sampled)), ("greedy", greedy), ("sampled", sampled)):
            out[e][split] = {"n": int(m.sum()), "top1": float(top1[e][m].sum()), "top5": float(top5[e][m].sum()),
                             "accept": float(acc[e][m].sum()), "run": float(run[m].sum())}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2-135m.yaml")
    ap.add_argument("--cache-dir", help="override collect.cache_dir")
    ap.add_argument("--max-shards", type=int, help="only the first N shards (quick look)")
    ap.add_argument("--seq-stride", type=int, default=1, help="use every k-th sequence of each shard (faster)")
    ap.add_argument("--chunk", type=int, default=2048, help="rows per LM-head matmul")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the table as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    cfg = load_config(args.config)
    cache = Path(args.cache_dir or cfg["collect"]["cache_dir"])
    manifest = json.loads((cache / "manifest.json").read_text())
    layers = manifest["exit_layers"]
    model, _ = load_model((cfg.get("model") or {}).get("name_or_path"))
    fp = model_fingerprint(model, None)
    if fp["weights_sha256"] != manifest["model"]["weights_sha256"]:
        raise RuntimeError("The loaded model is not the one the cache was collected with")

    shards = manifest["shards"][:args.max_shards] if args.max_shards else manifest["shards"]
    totals: dict = {}
    for sh in tqdm(shards, desc="shards", file=sys.stderr):
        stats = shard_stats(model, load_file(str(cache / sh["file"])), layers, args.chunk, args.seq_stride)
        for e, splits in stats.items():
            for split, d in splits.items():
                acc = totals.setdefault(e, {}).setdefault(split, dict.fromkeys(d, 0.0))
                for k, v in d.items():
                    acc[k] += v

    table = {e: {split: {"n": int(d["n"]), **{k: d[k] / max(d["n"], 1) for k in ("top1", "top5", "accept", "run")}}
                 for split, d in splits.items()} for e, splits in totals.items()}
    n_layers = manifest["model"]["num_hidden_layers"]
    print(f"untrained exit (final norm + LM head at layer E) vs full {n_layers}-layer model, "
          f"{len(shards)} shards, sequence stride {args.seq_stride}, rows predicting response tokens")
    print(f"{'E':>3} {'split':>8} {'rows':>7} {'top1':>6} {'top5':>6} {'accept':>7} {'run<=8':>7}")
    for e in layers:
        for split in ("all", "greedy", "sampled"):
            d = table[e][split]
            print(f"{e:>3} {split:>8} {d['n']:>7} {d['top1']:>6.3f} {d['top5']:>6.3f} {d['accept']:>7.3f} {d['run']:>7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cache": str(cache), "settings_hash": manifest["settings_hash"],
                                               "n_shards": len(shards), "seq_stride": args.seq_stride, "layers": table}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
