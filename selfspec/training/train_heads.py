"""Train early-exit heads by self-distillation on data from `train.collect`. Reads top to bottom.

    python -m train.train_heads --config configs/smollm2-135m.yaml
    python -m train.train_heads --config configs/smollm2-135m.yaml --device cuda --dtype bfloat16
    selfspec train-heads --config configs/smollm2-135m.yaml

The teacher is the full model itself: its next-token distribution lm_head(hidden.final) at every stored
position. One head per exit layer is trained from the same pass over the cached hidden states; the base model
stays frozen (the shared cache depends on it). Output: `model.selfspec.save_pretrained(out_dir)`, loadable
with `selfspec.wrap(model, out_dir)`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import yaml
from safetensors.torch import save_file

from .rows import load_rows, load_sequences, pad_batch


# ----------------------------------------------------------------------------------------------------------------
# config: defaults here, the YAML's `train:` section overrides them, then the command line
@dataclass
class TrainConfig:
    model: str | None = None  # name or path for selfspec.models.resolve_model; None = smollm2-135m
    data_dir: str = "data_cache/smollm2-135m"  # shards + manifest.json written by train.collect
    out_dir: str = "runs/smollm2-135m-heads"  # checkpoints and the final save_pretrained directory
    exit_layers: list = field(default_factory=lambda: [4, 6, 8, 12])  # one head each, all from one data pass
    head: str = "mlp"  # "mlp": residual MLP adapter; "attn": a copied decoder layer with its own KV cache;
    #                  "fused": a top-reading MLP fusing each state with the one before, then such a layer (EAGLE's)
    init_heads: str | None = None  # mlp and fused: trained heads to start from (same exits)
    rank: int = 1152  # hidden width of the MLP adapter
    context: str = "early"  # "top": the head also reads final states (attn: of verified positions; mlp: of the one before)
    source_layer: int | None = None  # attn only: the layer copied to start from; None = the exit layer itself
    seq_batch: int = 8  # attn and fused: whole sequences per step (they attend over them)
    loss_rows: int = 0  # attn and fused: answer rows per step the loss is taken on, drawn at random (0: all of them)
    round_len_max: int = 5  # attn "top" and fused: draft rounds of 1..this many tokens are sampled while training
    unroll: int = 1  # mlp "top" only: consecutive positions per sample, each after the first reading the head's own
    #                 estimate of the state before, as drafts 2.. do in the loop (1 = the true state only)
    draft_vocab_size: int = 8192  # the head scores only this many most frequent tokens; 0 = full vocabulary
    steps: int = 800  # optimizer steps
    batch_size: int = 256  # rows (positions) per step and head
    lr: float = 2e-3  # AdamW peak learning rate (cosine decay after warm-up)
    warmup: int = 40  # linear warm-up steps
    weight_decay: float = 0.0
    ce_weight: float = 0.3  # weight of cross-entropy on the teacher's top-1 next to the KL term
    feature_weight: float = 0.0  # weight of a smooth-L1 loss pulling the head's normed state to the final one (EAGLE's)
    holdout_fraction: float = 0.1  # sequences kept out of training to measure agreement
    eval_every: int = 200  # steps between held-out agreement measurements
    checkpoint_every: int = 200  # steps between resumable checkpoints (and at least every CHECKPOINT_SECONDS)
    default_exit_layer: int | None = None  # exit layer written as the config's default; None = best agreement
    max_draft_tokens: int = 4  # written into the saved config (calibrate refines it)
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"  # head training dtype: float32 on CPU, bfloat16 on a GPU
    save_dtype: str = "bfloat16"  # dtype of the saved head weights (bf16 halves the checkpoint; loading upcasts)
    threads: int | None = None  # torch intra-op threads on CPU
    # seconds for the whole run, loading and saving included (0: no limit): the first PROBE_STEPS steps of this run
    # are timed and `steps` becomes what fits (at least that many, at most what a resumed checkpoint planned); the
    # run stops at the step that reaches the deadline in any case
    time_budget: float = 0.0


# `selfspec train-heads --help` text of each TrainConfig field (its comment above, for the command line)
OPTION_HELP = {
    "model": "model name or path (default: smollm2-135m)",
    "data_dir": "directory with the shards and manifest.json written by train.collect",
    "out_dir": "where checkpoints and the final heads (save_pretrained) go",
    "exit_layers": "comma-separated exit layers, one head each, all trained from one data pass (e.g. 4,6,8,12)",
    "head": "head design: mlp (residual MLP adapter), attn (a copied decoder layer with its own KV cache) or fused "
            "(an mlp head reading the previous final state, then such a layer over what it fuses: EAGLE's draft "
            "model; it always reads final states, whatever --context says)",
    "init_heads": "a directory of trained heads at the same exit layers to start from (for example on data of "
                  "your own): for --head mlp, mlp heads of the same context (a copy head's trust in lookups is left "
                  "out: run train-copy again); for --head fused, mlp heads with context top (the fused head drafts "
                  "as they do until training mixes its layer in) or fused heads",
    "rank": "hidden width of the MLP adapter",
    "context": "early, or top: the head also reads final states (attn: of verified positions as its context; mlp: "
               "of the position before, EAGLE's feature)",
    "source_layer": "attn only: the decoder layer copied to start from (default: the exit layer itself)",
    "seq_batch": "attn and fused: whole sequences per step",
    "loss_rows": "attn and fused: answer rows per step the loss is taken on, drawn at random (0: all); the LM head "
                 "over every row costs more than the layer",
    "round_len_max": "attn with context top, and fused: draft rounds of 1..this many tokens are sampled in training "
                     "(a fused head runs its layer once per draft of a round, on its own estimates)",
    "unroll": "mlp with context top only: consecutive positions per sample, each after the first reading the head's "
              "own estimate of the state before (what drafts 2.. read in the loop); 1 = the true state only",
    "draft_vocab_size": "the head scores only this many most frequent tokens; 0 = the full vocabulary",
    "steps": "optimizer steps",
    "batch_size": "rows (positions) per step and head",
    "lr": "AdamW peak learning rate (cosine decay after warm-up)",
    "warmup": "linear warm-up steps",
    "weight_decay": "AdamW weight decay",
    "ce_weight": "weight of cross-entropy on the teacher's top-1 next to the KL term",
    "feature_weight": "weight of a smooth-L1 loss between the head's normed state and the full model's final state, "
                      "which the next draft reads in its place (EAGLE's feature loss; 0: tokens only)",
    "holdout_fraction": "fraction of sequences kept out of training to measure agreement",
    "eval_every": "steps between held-out agreement measurements",
    "time_budget": "seconds for the whole run, loading and saving included: steps become what fits after a few "
                   "timed ones (0: --steps as given)",
    "checkpoint_every": "steps between resumable checkpoints",
    "default_exit_layer": "exit layer written as the saved config's default (default: the best agreement)",
    "max_draft_tokens": "draft length K written into the saved config (selfspec calibrate refines it)",
    "seed": "random seed",
    "device": "cpu, cuda, cuda:1, ...",
    "dtype": "head training dtype: float32 on CPU, bfloat16 on a GPU",
    "save_dtype": "dtype of the saved head weights (bfloat16 halves the file; loading upcasts)",
    "threads": "torch intra-op threads on CPU",
}


def load_config(argv) -> TrainConfig:
    p = argparse.ArgumentParser(
        prog="selfspec train-heads", description=__doc__.split("\n\n")[0],
        epilog="Each option overrides the same key of the --config YAML's train: section; options left out keep "
               "the YAML's value, else the TrainConfig default in selfspec/training/train_heads.py.")
    p.add_argument("--config", help="YAML file with a `train:` section (see configs/smollm2-135m.yaml)")
    for f in TrainConfig.__dataclass_fields__.values():
        p.add_argument("--" + f.name.replace("_", "-"), default=None, help=OPTION_HELP.get(f.name, "see TrainConfig"),
                       type=(lambda s: [int(x) for x in s.split(",")]) if f.name == "exit_layers" else str)
    args = p.parse_args(argv)
    values = {}
    if args.config:
        with open(args.config) as fh:
            data = yaml.safe_load(fh) or {}
        values.update(data.get("train") or {})
        values.setdefault("model", (data.get("model") or {}).get("name_or_path"))
        values.setdefault("data_dir", (data.get("collect") or {}).get("cache_dir", TrainConfig.data_dir))
    for name, f in TrainConfig.__dataclass_fields__.items():
        given = getattr(args, name)
        if given is not None:
            values[name] = given
    cfg = TrainConfig(**{k: v for k, v in values.items() if k in TrainConfig.__dataclass_fields__})
    if isinstance(cfg.source_layer, str):
        cfg.source_layer = None if cfg.source_layer.lower() in ("none", "null", "") else int(cfg.source_layer)
    for name in ("rank", "draft_vocab_size", "steps", "batch_size", "warmup", "eval_every", "checkpoint_every",
                 "seed", "max_draft_tokens", "seq_batch", "round_len_max", "unroll", "loss_rows"):
        setattr(cfg, name, int(getattr(cfg, name)))
    for name in ("lr", "weight_decay", "ce_weight", "holdout_fraction", "time_budget", "feature_weight"):
        setattr(cfg, name, float(getattr(cfg, name)))
    if cfg.unroll < 1 or (cfg.unroll > 1 and not (cfg.head == "mlp" and cfg.context == "top")):
        raise SystemExit(f"--unroll {cfg.unroll}: must be >= 1, and above 1 only for --head mlp --context top "
                         "(the head that reads its own estimate of the previous state).")
    if cfg.init_heads is not None and cfg.head == "attn":
        raise SystemExit("--init-heads starts mlp and fused heads from trained ones; it does not apply to --head attn.")
    return cfg


# ----------------------------------------------------------------------------------------------------------------
SEQUENCE_HEADS = ("attn", "fused")  # heads that attend over whole sequences (the others train on rows)
PROBE_STEPS = 10  # steps timed before a time budget sets the total
# a checkpoint at least this often as well, so that a stop loses minutes, not hours, where steps are slow
CHECKPOINT_SECONDS = 60.0


def steps_within(budget: float, spent: float, done: int, per_step: float, most: int) -> int:
    """Total steps that fit in `budget` seconds after `done` steps took `spent`, at `per_step` seconds each, with
    a tenth of what is left kept for evaluation and saving: at least `done`, at most `most`."""
    return max(done, min(most, done + int(0.9 * (budget - spent) / max(per_step, 1e-9))))


# A checkpoint is safetensors (tensors) with its structure as JSON in the metadata: nothing read back is a pickle.
def save_checkpoint(path: str, heads: dict, opt, step: int, steps: int) -> None:
    """Heads' weights, the optimizer's state and the step, written atomically (a crash keeps the last one)."""
    # heads share their draft vocabulary's tensor, which safetensors stores once per name: clone each
    tensors = {f"head.{e}.{k}": v.detach().clone().contiguous() for e, h in heads.items()
               for k, v in h.state_dict().items()}
    state = opt.state_dict()
    for i, slots in state["state"].items():
        for k, v in slots.items():
            tensors[f"opt.{i}.{k}"] = v.detach().clone().contiguous() if torch.is_tensor(v) else torch.tensor(v)
    meta = {"step": step, "steps": steps, "param_groups": state["param_groups"]}
    save_file(tensors, path + ".tmp", metadata={"selfspec_checkpoint": json.dumps(meta)})
    os.replace(path + ".tmp", path)


def load_checkpoint(path: str, heads: dict, opt, device) -> tuple[int, int]:
    """Restore what save_checkpoint wrote into `heads` and `opt`; (step, planned steps)."""
    from safetensors import safe_open

    with safe_open(path, "pt", device=str(device)) as f:
        meta = json.loads(f.metadata()["selfspec_checkpoint"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for e, h in heads.items():
        prefix = f"head.{e}."
        h.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    slots: dict = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, i, name = k.split(".", 2)
            slots.setdefault(int(i), {})[name] = v
    opt.load_state_dict({"state": slots, "param_groups": meta["param_groups"]})
    return int(meta["step"]), int(meta["steps"])


def checkpoint_vocab(path: str) -> torch.Tensor | None:
    """The draft vocabulary a checkpoint's heads were trained with (the data may have grown since)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        key = next((k for k in f.keys() if k.startswith("head.") and k.endswith(".vocab_ids")), None)
        return None if key is None else f.get_tensor(key)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def unrolled_loss(head, rows, idx, key, adapter, vocab_ids, vocab_index, ce_weight, device, dtype, unroll=1,
                  feature_weight=0.0):
    """A head's distillation loss on the rows `idx` (N,) of `rows` (layer-E states under `key`), each row the
    start of a run of `unroll` consecutive positions of one sequence (1: the rows alone). A top-reading head's
    first position reads the true previous final state, each later one the head's own normed output at the
    position before (as the loop's drafts 2.. do), gradients flowing through it. The mean over positions of
    distill_terms."""
    from selfspec.draft_logits import lm_logits

    def column(name, j):
        return rows[name][idx + j].to(device, dtype)
    prev, loss = column("prev.final", 0) if head.reads_top else None, 0.0
    for j in range(unroll):
        normed = head.normed(column(key, j), adapter, prev)  # (N, H)
        top1 = rows["teacher_top1"][idx + j].long().to(device)
        loss = loss + distill_terms(lm_logits(adapter, normed, head.vocab_ids), column("hidden.final", j), top1,
                                    adapter, vocab_ids, vocab_index, ce_weight, normed, feature_weight)
        prev = normed
    return loss / unroll


def unroll_starts(seq: torch.Tensor, unroll: int) -> torch.Tensor:
    """Rows i whose next `unroll - 1` rows belong to the same sequence (rows of a sequence are contiguous)."""
    n = len(seq) - (unroll - 1)
    ok = torch.ones(max(n, 0), dtype=torch.bool)
    for j in range(1, unroll):
        ok &= seq[j : j + n] == seq[:n]
    return ok.nonzero()[:, 0]


def distill_terms(head_logits, final, top1, adapter, vocab_ids, vocab_index, ce_weight, normed=None,
                  feature_weight=0.0):
    """The loss from the head's (N, V_d) logits; the teacher's from final-normed states (N, H). With
    `feature_weight`, also the smooth-L1 distance of the head's (N, H) `normed` states from `final`: the estimate a
    top-reading head's next draft reads in place of the final state."""
    with torch.no_grad():
        teacher = torch.log_softmax(adapter.logits(final, vocab_ids).float(), dim=-1)  # (N, V_d)
    student = torch.log_softmax(head_logits.float(), dim=-1)
    kl = torch.sum(teacher.exp() * (teacher - student), dim=-1).mean()
    target = vocab_index[top1]  # position of the teacher's top-1 in the draft vocabulary, -1 if absent
    ce = torch.nn.functional.nll_loss(student, target.clamp(min=0), reduction="none")[target >= 0].mean()
    loss = kl + ce_weight * ce
    if feature_weight and normed is not None:
        loss = loss + feature_weight * torch.nn.functional.smooth_l1_loss(normed.float(), final.float())
    return loss


def head_chunks(head, rows, key, adapter, chunk):
    """(rows slice, the head's (N, V_d) logits there) over the held-out rows, `chunk` at a time."""
    for i in range(0, len(rows["teacher_top1"]), chunk):
        h = rows[key][i : i + chunk].to(head_device(head, adapter), head_dtype(head, adapter))
        prev = rows["prev.final"][i : i + chunk].to(h.device, h.dtype) if head.reads_top else None
        yield slice(i, i + chunk), head(h, adapter, prev)


@torch.no_grad()
def agreement(head, rows, key, adapter, chunk=4096) -> float:
    """Fraction of held-out positions where the head's argmax equals the full model's argmax."""
    hits = 0
    for part, logits in head_chunks(head, rows, key, adapter, chunk):
        ids = head.token_ids(logits.argmax(-1))
        hits += int((ids.cpu() == rows["teacher_top1"][part].long()).sum())
    return hits / max(1, len(rows["teacher_top1"]))


@torch.no_grad()
def sampling_agreement(head, rows, key, adapter, temperature: float = 1.0, chunk: int = 1024) -> float:
    """Mean over held-out positions of sum_v min(p(v), q(v)), p the full model's distribution and q the head's at
    `temperature`: the chance that rejection sampling accepts the head's first draft (q is 0 outside a draft
    vocabulary, so those tokens add nothing)."""
    total = 0.0
    for part, logits in head_chunks(head, rows, key, adapter, chunk):
        q = torch.softmax(logits.float() / temperature, dim=-1)  # (N, V_d)
        final = rows["hidden.final"][part].to(logits.device, head_dtype(head, adapter))
        p = torch.softmax(adapter.logits(final).float() / temperature, dim=-1)  # (N, V)
        if head.vocab_ids is not None:
            p = p[:, head.vocab_ids.to(p.device)]
        total += float(torch.minimum(p, q).sum())
    return total / max(1, len(rows["teacher_top1"]))


def attention_step(head, seqs, adapter, cfg, round_len=1, offset=0, rows_at_most=0, g=None):
    """Head logits, teacher data and the head's normed states at the answer rows of a batch of sequences: (N, V_d),
    (N, H), (N,), (N, H); with `rows_at_most`, at that many of them drawn by `g` (the LM head is scored on those
    only)."""
    dtype = head_dtype(head, adapter)
    early, lengths = pad_batch(seqs, f"hidden.{head.exit_layer}", cfg.device, dtype)
    final, _ = pad_batch(seqs, "hidden.final", cfg.device, dtype)
    loss_rows, _ = pad_batch(seqs, "loss", cfg.device, None)
    top1, _ = pad_batch(seqs, "teacher_top1", cfg.device, None)
    out = head.teacher_forced_states(early, final, adapter, lengths, round_len, offset)
    rows = loss_rows.bool().nonzero()  # (N, 2) answer rows
    if 0 < rows_at_most < len(rows):
        rows = rows[torch.randperm(len(rows), generator=g)[:rows_at_most].to(rows.device)]
    b, t = rows[:, 0], rows[:, 1]
    return head.logits(out[b, t], adapter), final[b, t], top1[b, t].long(), adapter.final_norm(out[b, t])


@torch.no_grad()
def attention_agreement(head, seqs, adapter, cfg, round_len=1) -> float:
    hits = total = 0
    for i in range(0, len(seqs), cfg.seq_batch):
        logits, _, top1, _ = attention_step(head, seqs[i : i + cfg.seq_batch], adapter, cfg, round_len)
        pred = logits.argmax(-1)
        ids = head.token_ids(pred)
        hits, total = hits + int((ids == top1).sum()), total + len(top1)
    return hits / max(1, total)


def head_device(head, adapter):
    """Where the head runs: its weights' device, or for a parameterless head (the plain exit: the final norm and
    the LM head) the LM head's."""
    params = list(head.parameters())
    return params[0].device if params else adapter.lm_head.weight.device


def head_dtype(head, adapter):
    """The head's weights' dtype, or for the parameterless plain exit the model's (the LM head's)."""
    params = list(head.parameters())
    return params[0].dtype if params else adapter.lm_head.weight.dtype


def refuse_tensor_parallel(model=None) -> None:
    """Heads train in one process on hidden states cached by train.collect; a torchrun job (or a model whose
    weights are sharded DTensors) would train one copy per rank and race on out_dir."""
    from selfspec.distributed import is_tensor_parallel

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or (model is not None and is_tensor_parallel(model)):
        raise SystemExit("train.train_heads runs in one process, not under torchrun or on a tensor-parallel model: "
                         "run it without torchrun (heads train on cached hidden states), then load the heads on "
                         "every rank with selfspec.wrap(model, out_dir).")


def main(argv=None) -> int:
    started = time.time()  # --time-budget counts from here
    cfg = load_config(argv)
    refuse_tensor_parallel()
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)

    from selfspec.heads import ExitHead
    from tqdm import tqdm

    model, tok = frozen_model(cfg, dtype)
    adapter = model.selfspec.adapter

    mlp_top = cfg.head == "mlp" and cfg.context == "top"
    train_rows, held_rows, manifest = load_rows(cfg.data_dir, cfg.exit_layers, cfg.holdout_fraction, cfg.seed,
                                                prev_top=mlp_top)
    n = len(train_rows["target_ids"])
    print(f"{n} training rows, {len(held_rows['target_ids'])} held-out rows, exit layers {cfg.exit_layers}")

    ckpt = os.path.join(cfg.out_dir, "checkpoint.safetensors")
    resuming = os.path.isfile(ckpt)
    vocab_ids, vocab_index = draft_vocabulary(cfg, model, tok, train_rows, held_rows, ckpt if resuming else None)
    heads, measure, train_seqs = build_heads(cfg, adapter, vocab_ids, dtype, held_rows)
    t_measure = time.time()
    baseline = {e: agreement(ExitHead(e, vocab_ids), held_rows, f"hidden.{e}", adapter) for e in cfg.exit_layers}
    # what the end costs (held-out and sampled agreement, saving) is kept out of the steps' share of a budget
    reserve = 3 * (time.time() - t_measure) + 2.0
    print("untrained exit agreement:", {e: round(a, 4) for e, a in baseline.items()})
    params = [p for h in heads.values() for p in h.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    # resume from the last checkpoint, if any
    os.makedirs(cfg.out_dir, exist_ok=True)
    start = 0
    if resuming:
        start, cfg.steps = load_checkpoint(ckpt, heads, opt, cfg.device)
        print(f"resumed at step {start} of {cfg.steps}")

    g = torch.Generator().manual_seed(cfg.seed + start)
    starts = unroll_starts(train_rows["seq"], cfg.unroll)  # every row when unroll is 1
    history = []
    bar = tqdm(desc="train-heads", initial=start, total=cfg.steps)
    t0 = time.time()
    deadline = started + cfg.time_budget - reserve if cfg.time_budget > 0 else float("inf")
    saved_at = t0
    step = start
    while step < cfg.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = batch_loss(cfg, heads, adapter, (train_seqs if cfg.head in SEQUENCE_HEADS else train_rows), starts, g,
                          vocab_ids, vocab_index, dtype)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar.update()
        bar.set_postfix(loss=f"{loss.item() / len(heads):.3f}")
        fit_to_budget(cfg, bar, step + 1, start, t0, deadline)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            agree = {e: round(measure(e, h), 4) for e, h in heads.items()}
            history.append({"step": step + 1, "loss": loss.item() / len(heads), "agreement": agree})
            tqdm.write(f"step {step + 1}: held-out top-1 agreement {agree}")
        if ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps
                or time.time() - saved_at > CHECKPOINT_SECONDS):
            save_checkpoint(ckpt, heads, opt, step + 1, cfg.steps)
            saved_at = time.time()
        step += 1
    bar.close()

    # the result: heads + config through save_pretrained (safetensors + JSON), bf16 keeps it small
    final_agree = {e: measure(e, h) for e, h in heads.items()}
    sampled = {} if cfg.head in SEQUENCE_HEADS else {
        e: sampling_agreement(h, held_rows, f"hidden.{e}", adapter) for e, h in heads.items()}
    metadata = {"trained_with": asdict(cfg), "untrained_agreement": baseline, "agreement": final_agree,
                "sampling_agreement": sampled, "history": history, "train_seconds": time.time() - t0,
                "data": {"rows": n, "manifest_settings_hash": manifest.get("settings_hash")}}
    save_heads(model, cfg, heads, final_agree, sampled, metadata)
    return 0


def frozen_model(cfg: TrainConfig, dtype):
    """The frozen base model, wrapped: the heads reach its final norm and LM head through its adapter."""
    import selfspec
    from selfspec.models import resolve_model

    model, tok = resolve_model(cfg.model or "smollm2-135m", dtype=dtype, device=cfg.device)
    refuse_tensor_parallel(model)
    model.requires_grad_(False)
    selfspec.wrap(model, exit_layer=cfg.exit_layers[0])
    return model, tok


def fit_to_budget(cfg: TrainConfig, bar, done: int, start: int, t0: float, deadline: float) -> None:
    """After `done` steps: with a time budget, the first PROBE_STEPS of this run decide the total (and so the lr
    schedule); a run past its deadline (evaluations ran longer than the probe foresaw) ends here."""
    from tqdm import tqdm

    if cfg.time_budget > 0 and done == start + PROBE_STEPS:
        spent = time.time() - t0
        cfg.steps = steps_within(deadline - t0, spent, done, spent / PROBE_STEPS, cfg.steps)
        cfg.warmup = min(cfg.warmup, max(1, cfg.steps // 10))
        bar.total = cfg.steps
        tqdm.write(f"time budget {cfg.time_budget:.0f} s: {cfg.steps} steps ({spent / PROBE_STEPS:.2f} s each)")
    if time.time() > deadline and done < cfg.steps:
        cfg.steps = done
        bar.total = cfg.steps
        tqdm.write(f"time budget {cfg.time_budget:.0f} s reached: training ends at step {cfg.steps}")


def draft_vocabulary(cfg: TrainConfig, model, tok, train_rows, held_rows, checkpoint: str | None):
    """(vocab_ids, vocab_index): the heads' draft vocabulary (None: the full one), the most frequent response tokens
    of the training data plus the stop tokens, or a resumed checkpoint's own (the data may have grown since); and
    each token's column in it (-1 outside)."""
    from selfspec.heads import frequent_token_ids
    from selfspec.tools.measure import eos_ids_of

    vocab_ids, vocab_size = None, model.selfspec.adapter.vocab_size
    if cfg.draft_vocab_size:
        stops = eos_ids_of(model, tok)
        vocab_ids = frequent_token_ids(train_rows["target_ids"], cfg.draft_vocab_size, stops).to(cfg.device)
        covered = torch.isin(held_rows["teacher_top1"].long(), vocab_ids.cpu()).float().mean()
        print(f"draft vocabulary {len(vocab_ids)} tokens covers {covered:.1%} of held-out teacher top-1")
        if checkpoint is not None:
            vocab_ids = checkpoint_vocab(checkpoint).to(cfg.device)
    if cfg.init_heads and checkpoint is None:  # heads started from trained ones keep their draft vocabulary
        vocab_ids = next(iter(init_heads(cfg, model.selfspec.adapter).values())).vocab_ids
        vocab_ids = None if vocab_ids is None else vocab_ids.to(cfg.device)
    if vocab_ids is None:
        return None, torch.arange(vocab_size, device=cfg.device)
    vocab_index = torch.full((vocab_size,), -1, dtype=torch.long, device=cfg.device)
    vocab_index[vocab_ids] = torch.arange(len(vocab_ids), device=cfg.device)
    return vocab_ids, vocab_index


def build_heads(cfg: TrainConfig, adapter, vocab_ids, dtype, held_rows):
    """({exit layer: new head}, measure(e, head) -> its held-out agreement, the training sequences of attention
    heads (None for MLP heads, which train on rows))."""
    from selfspec.heads import AttentionHead, FusedHead, MLPHead

    if cfg.head in SEQUENCE_HEADS:  # a copy of the exit layer (or source_layer) with its own KV cache
        if cfg.head == "attn":
            heads = {e: AttentionHead.from_model(adapter, e, cfg.source_layer, cfg.context, vocab_ids)
                     for e in cfg.exit_layers}
        elif cfg.init_heads:
            heads = {e: h if isinstance(h, FusedHead) else FusedHead.from_mlp(h, adapter, cfg.source_layer)
                     for e, h in init_heads(cfg, adapter).items()}
        else:
            heads = {e: FusedHead.from_model(adapter, e, cfg.source_layer, cfg.rank, vocab_ids) for e in cfg.exit_layers}
        heads = {e: h.to(cfg.device, dtype) for e, h in heads.items()}
        train_seqs, held_seqs = load_sequences(cfg.data_dir, cfg.exit_layers, cfg.holdout_fraction, cfg.seed)
        return heads, lambda e, h: attention_agreement(h, held_seqs, adapter, cfg), train_seqs
    if cfg.head == "mlp" and cfg.init_heads:  # trained further: their rank, context and draft vocabulary
        heads = {e: plain_mlp(h, cfg).to(cfg.device, dtype) for e, h in init_heads(cfg, adapter).items()}
        return heads, lambda e, h: agreement(h, held_rows, f"hidden.{e}", adapter), None
    if cfg.head == "mlp":
        heads = {e: MLPHead(e, adapter.hidden_size, cfg.rank, vocab_ids, context=cfg.context).to(cfg.device, dtype)
                 for e in cfg.exit_layers}
        return heads, lambda e, h: agreement(h, held_rows, f"hidden.{e}", adapter), None
    raise ValueError(f"train.head must be one of 'mlp', 'attn', 'fused', got {cfg.head!r}.")


def plain_mlp(head, cfg: TrainConfig):
    """A trained mlp head as the start of more training: the same weights without a copy head's trust in prompt
    lookup (train-copy fits that again), or one line where it is another kind or reads another context."""
    from selfspec.heads import MLPHead

    if not isinstance(head, MLPHead) or head.context != cfg.context:
        raise SystemExit(f"--init-heads {cfg.init_heads}: the head at layer {head.exit_layer} is {head.kind!r} with "
                         f"context {getattr(head, 'context', None)!r}; --head mlp --context {cfg.context} trains "
                         f"further only an mlp head with that context.")
    new = MLPHead(head.exit_layer, head.hidden_size, head.rank, head.vocab_ids, context=head.context)
    new.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith("copy_")})
    return new


def init_heads(cfg: TrainConfig, adapter) -> dict:
    """{exit layer: trained mlp top or fused head} from --init-heads, for every exit layer being trained, or one line
    saying what the directory lacks."""
    from selfspec.heads import FusedHead, MLPHead
    from selfspec.io import load_heads

    try:
        found = {h.exit_layer: h for h in load_heads(cfg.init_heads, adapter)}
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"--init-heads {cfg.init_heads}: {err}") from None
    if cfg.head == "mlp":  # plain_mlp checks each head's kind and context
        missing = [e for e in cfg.exit_layers if e not in found]
        if missing:
            raise SystemExit(f"--init-heads {cfg.init_heads} has no head at exit layers {missing}; train them first, "
                             "or leave --init-heads out.")
        return {e: found[e] for e in cfg.exit_layers}
    missing = [e for e in cfg.exit_layers if not (isinstance(found.get(e), FusedHead) or (
        isinstance(found.get(e), MLPHead) and found[e].reads_top))]
    if missing:
        raise SystemExit(f"--init-heads {cfg.init_heads} has no mlp head with context top (nor a fused head) at exit "
                         f"layers {missing}; train them with --head mlp --context top, or leave --init-heads out.")
    return {e: found[e] for e in cfg.exit_layers}


def batch_loss(cfg: TrainConfig, heads: dict, adapter, data, starts, g, vocab_ids, vocab_index, dtype):
    """One step's loss, summed over the heads: whole sequences for attention heads (a "top" head sees draft rounds of
    a random length and phase), else rows, or runs of consecutive rows (--unroll) drafted as the loop drafts them."""
    if cfg.head in SEQUENCE_HEADS:
        batch = [data[i] for i in torch.randint(0, len(data), (cfg.seq_batch,), generator=g)]
        round_len = int(torch.randint(1, cfg.round_len_max + 1, (1,), generator=g))
        offset = int(torch.randint(0, round_len, (1,), generator=g))
        return sum(sequence_loss(h, attention_step(h, batch, adapter, cfg, round_len, offset, cfg.loss_rows, g), adapter,
                                vocab_ids, vocab_index, cfg) for h in heads.values())
    idx = starts[torch.randint(0, len(starts), (cfg.batch_size,), generator=g)]
    return sum(unrolled_loss(h, data, idx, f"hidden.{e}", adapter, vocab_ids, vocab_index, cfg.ce_weight,
                             cfg.device, dtype, cfg.unroll, cfg.feature_weight) for e, h in heads.items())


def sequence_loss(head, step, adapter, vocab_ids, vocab_index, cfg: TrainConfig):
    """distill_terms of one attention_step; the feature term only for a fused head, whose next draft reads its
    normed state (an attention head's drafts read layer-E states)."""
    logits, final, top1, normed = step
    weight = cfg.feature_weight if head.reads_top else 0.0
    return distill_terms(logits, final, top1, adapter, vocab_ids, vocab_index, cfg.ce_weight, normed, weight)


def save_heads(model, cfg: TrainConfig, heads: dict, agree: dict, sampled: dict, metadata: dict) -> None:
    """The heads and a config whose exit layer is the best agreement (or --default-exit-layer), saved."""
    best = cfg.default_exit_layer or max(agree, key=agree.get)
    model.selfspec.config = model.selfspec.config.replace(exit_layer=best, max_draft_tokens=cfg.max_draft_tokens,
                                                          metadata=metadata)
    for e, h in heads.items():
        model.selfspec.heads[e] = h.to(getattr(torch, cfg.save_dtype)).eval()
    model.selfspec.save_pretrained(cfg.out_dir)
    print(f"saved heads {sorted(heads)} to {cfg.out_dir}; default exit layer {best}; "
          f"agreement {json.dumps({e: round(a, 4) for e, a in agree.items()})}, sampling agreement (sum of "
          f"min(p, q), temperature 1) {json.dumps({e: round(a, 4) for e, a in sampled.items()})}")


if __name__ == "__main__":
    sys.exit(main())
