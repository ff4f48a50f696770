"""Training rows and sequences from the shards `train.collect` writes, split into training and held-out parts.

MLP heads train on rows (one position each: its exit states, its final state, the teacher's token); attention heads
train on whole sequences, since they attend over them. Held-out sequences are drawn once per seed, so every head
trained on the same data is measured on the same text.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

# data: rows whose target is a response token; whole sequences held out for evaluation
def load_rows(data_dir: str, exit_layers: list[int], holdout_fraction: float, seed: int, prev_top: bool = False):
    """(train, held, manifest): rows whose target is an answer token, as dicts of (N, ...) tensors. With `prev_top`,
    "prev.final" holds each row's previous row's final state (zeros at a sequence's first row), a top-reading MLP
    head's input. Two passes over the shards: the first reads only their small per-row keys to size the result,
    the second copies one key of one shard at a time into it, so the peak stays near the result's own size (a
    job ten times this project's fits a GPU machine's host memory)."""
    from safetensors import safe_open

    manifest = json.load(open(os.path.join(data_dir, "manifest.json")))
    missing = [e for e in exit_layers if e not in manifest["exit_layers"]]
    if missing:
        raise ValueError(f"exit layers {missing} were not collected (have {manifest['exit_layers']}); "
                         "add them to collect.exit_layers and rerun train.collect.")
    shards = sorted(os.path.join(data_dir, f) for f in os.listdir(data_dir) if f.endswith(".safetensors"))
    if not shards:
        raise FileNotFoundError(f"No shards in {data_dir!r}: run python -m train.collect first.")
    plans = [shard_rows(path) for path in shards]  # (keep (R,) bool, seq of each kept row, sequence count)
    seq_base = torch.cumsum(torch.tensor([0] + [n for _, _, n in plans]), 0)
    held_seqs = held_out_sequences(int(seq_base[-1]), holdout_fraction, seed)
    is_held = [torch.isin(seq + base, held_seqs) for (_, seq, _), base in zip(plans, seq_base.tolist())]
    n_held = sum(int(h.sum()) for h in is_held)
    n_train = sum(len(h) for h in is_held) - n_held
    keys = [f"hidden.{e}" for e in exit_layers] + ["hidden.final", "target_ids", "teacher_top1"]
    train, held = {}, {}
    with safe_open(shards[0], "pt") as f:  # every shard holds the same keys, dtypes and widths
        for k in keys:
            row = f.get_slice(k)[:1]  # one row: its width and dtype, without reading the key
            train[k], held[k] = row.new_empty(n_train, *row.shape[1:]), row.new_empty(n_held, *row.shape[1:])
    if prev_top:
        train["prev.final"], held["prev.final"] = torch.empty_like(train["hidden.final"]), torch.empty_like(
            held["hidden.final"])
    train["seq"], held["seq"] = torch.empty(n_train, dtype=torch.long), torch.empty(n_held, dtype=torch.long)
    at_train = at_held = 0
    for path, (keep, seq, _), base, h in zip(shards, plans, seq_base.tolist(), is_held):
        columns = {"seq": seq + base}
        with safe_open(path, "pt") as f:
            for k in keys:
                column = f.get_tensor(k)
                columns[k] = column[keep]
                if prev_top and k == "hidden.final":
                    columns["prev.final"] = previous_rows(column, f.get_tensor("seq_offsets"))[keep]
                del column
        n_h = int(h.sum())
        for k, column in columns.items():
            train[k][at_train : at_train + len(h) - n_h] = column[~h]
            held[k][at_held : at_held + n_h] = column[h]
        at_train, at_held = at_train + len(h) - n_h, at_held + n_h
    return train, held, manifest


def shard_rows(path: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(keep, seq, n_seqs) of one shard from its small keys only: keep (R,) marks rows whose target is an answer
    token (the last prompt row predicts the first one), seq the shard-local sequence of each kept row."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        offsets, prompt_len, positions = (f.get_tensor(k) for k in ("seq_offsets", "seq_prompt_len", "positions"))
    seq_of_row = torch.repeat_interleave(torch.arange(len(offsets) - 1), offsets[1:] - offsets[:-1])
    keep = positions >= prompt_len[seq_of_row] - 1
    return keep, seq_of_row[keep], len(offsets) - 1


def previous_rows(final: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(R, H) each row's previous row's state within its sequence, zeros at a sequence's first row."""
    prev = torch.cat([torch.zeros_like(final[:1]), final[:-1]])
    prev[offsets[:-1]] = 0
    return prev


def held_out_sequences(n_seqs: int, fraction: float, seed: int) -> torch.Tensor:
    """Indices of the sequences kept out of training (at least one), the same for row and sequence loading."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n_seqs, generator=g)[: max(1, int(n_seqs * fraction))]


# attention heads read whole sequences: the 32 stored prompt positions as context, loss on the answer rows
def load_sequences(data_dir: str, exit_layers: list[int], holdout_fraction: float, seed: int):
    """(train, held) lists of per-sequence dicts of (T, ...) tensors, split by the same seed as load_rows."""
    keys = [f"hidden.{e}" for e in exit_layers] + ["hidden.final", "teacher_top1"]
    seqs = []
    for name in sorted(f for f in os.listdir(data_dir) if f.endswith(".safetensors")):
        path = os.path.join(data_dir, name)
        answer_rows, _, _ = shard_rows(path)  # the rows load_rows keeps: those predicting an answer token
        shard = load_file(path)
        offsets = shard["seq_offsets"].tolist()
        for i in range(len(offsets) - 1):
            rows = slice(offsets[i], offsets[i + 1])
            seq = {k: shard[k][rows] for k in keys}
            seq["loss"] = answer_rows[rows]
            seqs.append(seq)
    held = set(held_out_sequences(len(seqs), holdout_fraction, seed).tolist())
    return [s for i, s in enumerate(seqs) if i not in held], [s for i, s in enumerate(seqs) if i in held]


def pad_batch(seqs: list[dict], key: str, device, dtype):
    """Right-pad one key of several sequences: (B, T, ...) and lengths (B,)."""
    lengths = torch.tensor([len(s[key]) for s in seqs])
    out = torch.zeros(len(seqs), int(lengths.max()), *seqs[0][key].shape[1:], dtype=seqs[0][key].dtype)
    for b, s in enumerate(seqs):
        out[b, : len(s[key])] = s[key]
    return out.to(device, dtype if out.is_floating_point() else None), lengths.to(device)
