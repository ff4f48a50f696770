"""Make a trained MLP or fused exit head a copy head: fit how far it trusts prompt lookup's candidate. Reads top to
bottom.

    python -m train.train_copy --heads selfspec/assets/smollm2-135m --data-dir DIR --out-dir runs/copy
    selfspec train-copy --heads selfspec/assets/smollm2-135m --data-dir DIR --out-dir runs/copy

An MLP over one position cannot look a token up in the prompt; prompt lookup can, but blindly. A copy head gets
both: at every draft the candidate that followed the last earlier occurrence of the text's longest suffix of
n <= copy_max tokens is scored by its own LM-head logit plus `copy_bias[n] + copy_gate(state)`
(heads.MLPHead.rescore_copy). This script keeps the head's MLP as trained and fits only those copy_max + 1 + H
numbers, by cross-entropy against the full model's next token on rows of `train.collect` shards whose text has
a candidate. Rows of the sequences train_heads held out (same seed and fraction) measure first-draft agreement
before and after. Output: the head with its copy parameters, through save_pretrained, next to the config it
came with (calibrate again afterwards: drafts change). With --draft-vocab-size the head keeps only that many of
its draft-vocabulary tokens (the most frequent next tokens of the training rows): cheaper drafts, fitted as they
will be used.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

# ----------------------------------------------------------------------------------------------------------------
# config: every knob, with what it does


@dataclass
class CopyConfig:
    heads: str = "selfspec/assets/smollm2-135m"  # directory of the trained head (and the config saved with it)
    data_dir: str = "data_cache/smollm2-135m"  # train.collect shards + manifest.json (token ids and states)
    out_dir: str = "runs/smollm2-135m-copy"  # where the copy head and its config are saved
    model: str | None = None  # name or path for selfspec.models.resolve_model; None = smollm2-135m
    exit_layer: int | None = None  # the head to extend; None = the config's exit layer
    copy_max: int = 5  # longest suffix looked up (prompt lookup's ngram_max)
    # 0 = the head's draft vocabulary as trained; N = only its N most frequent next tokens in the shards' training
    # rows (plus the stop tokens): each draft then scores N LM-head rows, which costs about as much as a decoder
    # layer per 8192 rows here; the candidate is still scored by its own row when it falls outside them
    draft_vocab_size: int = 0
    rows: int = 200_000  # answer rows with a candidate, sampled evenly over the shards
    steps: int = 300  # full-batch Adam steps (the fit has copy_max + 1 + H parameters)
    lr: float = 0.05  # Adam learning rate
    holdout_fraction: float = 0.1  # sequences kept out (train_heads' rule, so the MLP never saw them either)
    seed: int = 0  # train_heads' seed for the held-out sequences, and the row sample's
    dtype: str = "bfloat16"  # model dtype the features are computed in (the dtype drafting runs in)
    threads: int | None = None  # torch intra-op threads on CPU


# `selfspec train-copy --help` text of each CopyConfig field (its comment above)
OPTION_HELP = {
    "heads": "directory of the trained head and the config saved with it",
    "data_dir": "train.collect shards and manifest.json (token ids and states)",
    "out_dir": "where the copy head and its config are saved",
    "model": "model name or path (default: smollm2-135m)",
    "exit_layer": "the head to extend (default: the config's exit layer)",
    "copy_max": "longest suffix looked up, in tokens (prompt lookup's ngram_max)",
    "draft_vocab_size": "keep only this many of the head's draft-vocabulary tokens, the most frequent next tokens "
                        "of the training rows, plus the stop tokens (0: as trained)",
    "rows": "answer rows with a candidate, sampled evenly over the shards",
    "steps": "full-batch Adam steps",
    "lr": "Adam learning rate",
    "holdout_fraction": "fraction of sequences kept out to measure agreement (train_heads' rule)",
    "seed": "seed of the held-out sequences (train_heads') and of the row sample",
    "dtype": "model dtype the features are computed in (the one drafting runs in)",
    "threads": "torch intra-op threads on CPU",
}


def parse_args(argv=None) -> CopyConfig:
    p = argparse.ArgumentParser(prog="selfspec train-copy", description=__doc__.split("\n\n")[0])
    for name, f in CopyConfig.__dataclass_fields__.items():
        kind = str if name in ("heads", "data_dir", "out_dir", "model", "dtype") else \
            float if name in ("lr", "holdout_fraction") else int
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=f.default,
                       help=f"{OPTION_HELP[name]} (default: {f.default})")
    cfg = CopyConfig(**vars(p.parse_args(argv)))
    if not 1 <= cfg.copy_max <= 16:
        raise SystemExit(f"--copy-max {cfg.copy_max}: must be in [1, 16] (the longest suffix looked up).")
    if cfg.draft_vocab_size < 0:
        raise SystemExit(f"--draft-vocab-size {cfg.draft_vocab_size}: must be 0 (keep the head's) or a size.")
    if cfg.rows < 1 or cfg.steps < 1:
        raise SystemExit(f"--rows {cfg.rows} --steps {cfg.steps}: both must be at least 1.")
    return cfg


# ----------------------------------------------------------------------------------------------------------------
# the head: the trained MLP head with copy parameters added (zero: it starts as the head plus its candidate)
def copy_head_from(head, copy_max: int, vocab_ids: torch.Tensor | None = None):
    """The head with copy parameters, over `vocab_ids` when given (else the head's own draft vocabulary)."""
    from selfspec.heads import FusedHead, MLPHead

    if isinstance(head, FusedHead):
        return head.with_copy(copy_max, vocab_ids).requires_grad_(False)
    if not isinstance(head, MLPHead):
        raise SystemExit(f"train.train_copy extends MLP and fused heads; the head at layer {head.exit_layer} is "
                         f"{head.kind!r}. Train one with python -m train.train_heads --head mlp first.")
    vocab_ids = head.vocab_ids if vocab_ids is None else vocab_ids
    new = MLPHead(head.exit_layer, head.hidden_size, head.rank, vocab_ids, context=head.context, copy_max=copy_max)
    new.load_state_dict({k: v for k, v in head.state_dict().items() if k != "vocab_ids"}, strict=False)
    return new.to(head.norm.weight.dtype).requires_grad_(False)


def smaller_vocab(vocab_ids: torch.Tensor | None, counts: torch.Tensor, size: int, stops: list[int]) -> torch.Tensor:
    """The `size` most frequent (by `counts`, (V,)) tokens of a draft vocabulary (None: the full one), plus the stop
    tokens, sorted: a head drafting over fewer LM-head rows."""
    ids = torch.arange(len(counts)) if vocab_ids is None else vocab_ids.cpu()
    if size >= len(ids):
        raise SystemExit(f"--draft-vocab-size {size}: the head's draft vocabulary has only {len(ids)} tokens; "
                         f"pass a smaller size, or 0 to keep it.")
    top = ids[torch.argsort(counts[ids], descending=True, stable=True)[:size]]
    return torch.unique(torch.cat([top, torch.tensor(stops, dtype=torch.long)]))


# ----------------------------------------------------------------------------------------------------------------
# data: answer rows with a candidate, their copy inputs and the head's frozen scores there
def shard_candidates(f, keep: torch.Tensor, copy_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token (R,), match (R,)) copy candidates of a shard's kept rows: row at position t looks up its sequence's
    tokens [0, t], as the drafter looks up the text ending at the token it drafts after."""
    from selfspec.lookup import prefix_copy_candidates

    tokens, tok_off = f.get_tensor("seq_tokens"), f.get_tensor("seq_token_offsets")
    offsets, positions, inputs = f.get_tensor("seq_offsets"), f.get_tensor("positions"), f.get_tensor("input_ids")
    token, match = torch.full_like(positions, -1), torch.zeros_like(positions)
    for s in range(len(offsets) - 1):
        lo, hi = int(offsets[s]), int(offsets[s + 1])
        rows = keep[lo:hi].nonzero()[:, 0] + lo
        if len(rows) == 0:
            continue
        text = tokens[tok_off[s] : tok_off[s + 1]].tolist()
        pos = positions[rows].long()
        if not torch.equal(torch.tensor(text)[pos], inputs[rows]):
            raise ValueError("shard rows do not index their sequence's tokens: was it written by train.collect?")
        cand, n = prefix_copy_candidates(text[: int(pos.max()) + 1], copy_max)
        token[rows], match[rows] = torch.tensor(cand)[pos].int(), torch.tensor(n)[pos].int()
    return token, match


def load_copy_rows(cfg: CopyConfig, exit_layer: int, prev_top: bool, vocab_size: int, fused=None) -> dict:
    """{train, held}: dicts of (N, ...) tensors of sampled answer rows that have a candidate; counts: (V,) how often
    each token is the full model's next token on all answer rows of the training sequences. `fused`: (head,
    adapter) of a fused head, whose normed state at each row ("normed") comes from its pass over the row's
    sequence up to it, as its first draft there sees it."""
    from safetensors import safe_open

    from .rows import held_out_sequences, previous_rows, shard_rows

    shards = sorted(os.path.join(cfg.data_dir, f) for f in os.listdir(cfg.data_dir) if f.endswith(".safetensors"))
    if not shards:
        raise SystemExit(f"No shards in {cfg.data_dir!r}: run python -m train.collect first.")
    plans = [shard_rows(path) for path in shards]
    seq_base = torch.cumsum(torch.tensor([0] + [n for _, _, n in plans]), 0).tolist()
    held_seqs = held_out_sequences(seq_base[-1], cfg.holdout_fraction, cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    per_shard = cfg.rows // len(shards) + 1
    parts, counts = [], torch.zeros(vocab_size, dtype=torch.long)
    for path, (keep, seq, _), base in zip(shards, plans, seq_base):
        with safe_open(path, "pt") as f:
            top1 = f.get_tensor("teacher_top1")
            counts += torch.bincount(top1[keep][~torch.isin(seq + base, held_seqs)].long(), minlength=vocab_size)
            token, match = shard_candidates(f, keep, cfg.copy_max)
            rows = (keep & (match > 0)).nonzero()[:, 0]
            rows = rows[torch.randperm(len(rows), generator=g)[:per_shard]].sort().values
            held = torch.isin(seq[torch.searchsorted(keep.nonzero()[:, 0], rows)] + base, held_seqs)
            part = {"early": f.get_tensor(f"hidden.{exit_layer}")[rows], "target": top1[rows],
                    "token": token[rows], "match": match[rows], "held": held}
            if fused is not None:
                part["normed"] = sequence_normed(*fused, f.get_tensor(f"hidden.{exit_layer}"),
                                                 f.get_tensor("hidden.final"), f.get_tensor("seq_offsets"), rows)
            elif prev_top:  # the final states are read only for a head that reads them
                part["prev"] = previous_rows(f.get_tensor("hidden.final"), f.get_tensor("seq_offsets"))[rows]
        parts.append(part)
    rows = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    held = rows.pop("held")
    if held.all() or not held.any():
        raise SystemExit(f"{int((~held).sum())} training and {int(held.sum())} held-out rows with a copy candidate "
                         f"in {cfg.data_dir!r}: need both; collect more text or change --holdout-fraction.")
    return {"train": {k: v[~held] for k, v in rows.items()}, "held": {k: v[held] for k, v in rows.items()},
            "counts": counts}


@torch.no_grad()
def sequence_normed(head, adapter, early: torch.Tensor, final: torch.Tensor, offsets: torch.Tensor,
                    rows: torch.Tensor) -> torch.Tensor:
    """(N, H) a fused head's normed states at a shard's `rows` (N,), each sequence that holds one run through the
    head at once (teacher-forced first drafts); early and final are the shard's (R, H) states."""
    dtype = head_dtype(head)
    out = torch.empty(len(rows), early.shape[1], dtype=dtype)
    seq = torch.searchsorted(offsets, rows, right=True) - 1  # (N,) each row's sequence
    for s in torch.unique(seq).tolist():
        lo, hi = int(offsets[s]), int(offsets[s + 1])
        mine = (seq == s).nonzero()[:, 0]
        states = head.teacher_forced_states(early[None, lo:hi].to(dtype), final[None, lo:hi].to(dtype), adapter)
        out[mine] = head.normed_out(states, adapter)[0, rows[mine] - lo]
    return out


def head_dtype(head) -> torch.dtype:
    return next(head.parameters()).dtype


@torch.no_grad()
def frozen_scores(head, adapter, rows: dict, chunk: int = 4096) -> dict:
    """What the fit needs of the frozen head per row: its normed state, the candidate's own logit, the log-sum-exp
    and the best of the other draft-vocabulary logits, and whether the target is the candidate, the best other
    token, or neither representable (then the row is dropped)."""
    from selfspec.draft_logits import lm_logits

    vocab = head.vocab_ids
    out = {k: [] for k in ("normed", "own", "lse_rest", "max_rest", "rest_right", "is_copy", "target_logit", "ok")}
    for i in range(0, len(rows["target"]), chunk):
        s = slice(i, i + chunk)
        dtype = head_dtype(head)
        if "normed" in rows:  # a fused head's, from its pass over each row's sequence
            normed = rows["normed"][s].to(dtype)
        else:
            prev = rows["prev"][s].to(dtype)[:, None] if "prev" in rows else None
            normed = head.normed(rows["early"][s].to(dtype)[:, None], adapter, prev)[:, 0]  # (n, H)
        logits = lm_logits(adapter, normed[:, None], vocab)[:, 0].float()  # (n, V_d)
        token, target = rows["token"][s].long(), rows["target"][s].long()
        ids = torch.unique(token)  # each candidate's LM-head row, scored once
        own = lm_logits(adapter, normed[:, None], ids)[:, 0].float()
        own = own.gather(1, torch.searchsorted(ids, token)[:, None])[:, 0]
        full_ids = vocab if vocab is not None else torch.arange(logits.shape[1])
        rest = logits.masked_fill(full_ids[None, :] == token[:, None], float("-inf"))  # the candidate scored apart
        in_vocab = full_ids[None, :] == target[:, None]  # (n, V_d)
        out["normed"].append(normed.float())
        out["own"].append(own)
        out["lse_rest"].append(torch.logsumexp(rest, dim=1))
        best = rest.max(dim=1)
        out["max_rest"].append(best.values)
        out["rest_right"].append(full_ids[best.indices] == target)
        out["is_copy"].append(token == target)
        out["target_logit"].append(torch.where(in_vocab.any(1), rest.masked_fill(~in_vocab, float("-inf")).max(1)
                                               .values, torch.zeros_like(own)))
        out["ok"].append((token == target) | (in_vocab.any(1) & (token != target)))
    scores = {k: torch.cat(v) for k, v in out.items()}
    scores["match"] = rows["match"].long()
    return scores


# ----------------------------------------------------------------------------------------------------------------
# the fit: cross-entropy over the draft vocabulary with the candidate's logit as copy_score gives it
def copy_loss(head, sc: dict) -> torch.Tensor:
    score = head.copy_score(sc["own"], sc["normed"], sc["match"])
    log_z = torch.logaddexp(sc["lse_rest"], score)
    return (log_z - torch.where(sc["is_copy"], score, sc["target_logit"]))[sc["ok"]].mean()


@torch.no_grad()
def agreement(head, sc: dict) -> float:
    """First-draft agreement on these rows with the head's copy parameters as they are (all zero: the plain head,
    which also scores out-of-vocabulary candidates by their own logit)."""
    pick = head.copy_score(sc["own"], sc["normed"], sc["match"]) > sc["max_rest"]
    return float(torch.where(pick, sc["is_copy"], sc["rest_right"]).float().mean())


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    import selfspec
    from selfspec.models import resolve_model

    t0 = time.perf_counter()
    model, tok = resolve_model(cfg.model or "smollm2-135m", dtype=cfg.dtype)
    model.eval().requires_grad_(False)
    selfspec.wrap(model, cfg.heads)
    engine = model.selfspec
    exit_layer = cfg.exit_layer if cfg.exit_layer is not None else engine.config.exit_layer
    head = copy_head_from(engine.head_for(exit_layer), cfg.copy_max)
    rows = load_copy_rows(cfg, exit_layer, head.reads_top, engine.adapter.vocab_size,
                          (head, engine.adapter) if head.stateful else None)
    counts = rows.pop("counts")
    if cfg.draft_vocab_size:
        from selfspec.tools.measure import eos_ids_of

        vocab_ids = smaller_vocab(head.vocab_ids, counts, cfg.draft_vocab_size, eos_ids_of(model, tok))
        head = copy_head_from(head, cfg.copy_max, vocab_ids.to(next(head.parameters()).device))
        print(f"draft vocabulary cut to {len(vocab_ids)} tokens: {float(counts[vocab_ids].sum() / counts.sum()):.1%}"
              f" of the training rows' next tokens")
    scores = {k: frozen_scores(head, engine.adapter, v) for k, v in rows.items()}
    print(f"{len(scores['train']['own'])} training rows, {len(scores['held']['own'])} held-out rows with a "
          f"candidate ({time.perf_counter() - t0:.0f} s)")
    before = agreement(head, scores["held"])

    params = [head.copy_bias, head.copy_gate.weight]
    for p in params:
        p.data = p.data.float()
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=cfg.lr)
    with torch.no_grad():
        loss_before = float(copy_loss(head, scores["train"]))
    for step in range(cfg.steps):
        loss = copy_loss(head, scores["train"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            print(f"step {step}: loss {loss.item():.4f}, held-out agreement {agreement(head, scores['held']):.1%}")
    head.requires_grad_(False)
    after = agreement(head, scores["held"])
    with torch.no_grad():
        loss_after = float(copy_loss(head, scores["train"]))

    engine.add_head(head)
    engine.save_pretrained(cfg.out_dir)
    report = {"config": asdict(cfg), "exit_layer": exit_layer, "copy_bias": head.copy_bias.tolist(),
              "draft_vocab_size": None if head.vocab_ids is None else len(head.vocab_ids),
              "held_out_rows_with_candidate": len(scores["held"]["own"]),
              "train_loss_before": loss_before, "train_loss_after": loss_after,
              "held_out_agreement_plain_head": before, "held_out_agreement_copy_head": after,
              "seconds": round(time.perf_counter() - t0, 1)}
    with open(os.path.join(cfg.out_dir, "train_copy.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
