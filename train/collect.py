"""Collect self-distillation data for early-exit heads.

    python -m train.collect --config configs/smollm2-135m.yaml [--max-questions 4] [--cache-dir DIR]

One shard = one batched ``generate`` call. Prompts come from the *train* split of Spec-Bench
only (the eight MT-bench categories). Each question yields ``samples_per_prompt`` chains:
chain 0 is greedy, the others are sampled. Turn 1 is the first user turn; turn 2 is a two-turn
chat made of the first turn, the same chain's own turn-1 answer and the second user turn.
Prompts are rendered with the tokenizer's chat template and generated with left padding.

While generating, forward hooks keep what a teacher-forced pass over prompt + response would
give (the same forward calls, so no second pass): for the response positions plus the last
``prompt_context_tokens`` prompt positions, the residual stream at every configured exit
layer E (``hidden_states[E]``, the output of layers [0, E), i.e. what an exit head at E sees),
the final hidden state after the final norm (teacher logits = ``lm_head(hidden.final)``), and
the argmax / probability of the full model's fp32 logits. Row t is the position whose output
predicts token t + 1; the last token of a sequence has no row (nothing follows it).

Shard layout (safetensors, ``<cache_dir>/t{turn}-c{chain}-{idx:03d}.safetensors``, chain 0 = greedy)::

    per row (N rows, sequences concatenated in order):
      hidden.{E}        [N, H] store_dtype   residual stream entering layer E
      hidden.final      [N, H] store_dtype   last layer output after the final norm
      input_ids         [N] int32            token at this position
      target_ids        [N] int32            token at position + 1 (what this row predicts)
      positions         [N] int32            absolute position in the sequence
      is_response       [N] uint8            1 if the token at this position was generated
      teacher_top1      [N] int32            argmax of the full model's fp32 logits here
      teacher_top1_prob [N] float32          its probability (temperature 1)
    per sequence (S rows):
      seq_offsets       [S+1] int64          rows [seq_offsets[i], seq_offsets[i+1]) belong to seq i
      seq_tokens        [sum len] int32      full token ids (prompt + response), concatenated
      seq_token_offsets [S+1] int64          slices of seq_tokens
      seq_prompt_len, seq_first_pos, seq_qid, seq_turn, seq_chain, seq_finished  [S] int32

Rows whose target is a response token: ``positions >= seq_prompt_len - 1`` (the last prompt
row predicts the first response token). In sampled chains the target is the sampled token,
not necessarily ``teacher_top1``. Per-sequence details (question id, category, response
text, ...) are in the shard's safetensors metadata (key ``selfspec``, JSON); ``manifest.json``
summarises the whole cache.

Resumable: shards already written with the same settings hash are skipped; a shard written
with other settings aborts the run (use another ``--cache-dir`` or ``--overwrite``).
Every shard reseeds torch from (seed, shard name), so reruns reproduce the same data; raising
``samples_per_prompt`` later only adds the new chains' shards.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from selfspec.prompts import EVAL_CATEGORIES, TRAIN_CATEGORIES  # the Spec-Bench split, defined once

FORMAT_VERSION = 2


COLLECT_DEFAULTS = {
    "questions": None,  # None: the Spec-Bench copy shipped in the package (selfspec/assets/spec_bench)
    "categories": list(TRAIN_CATEGORIES),
    "turns": [1, 2],
    "samples_per_prompt": 3,
    "temperature": 0.8,
    "top_p": 0.95,
    "max_new_tokens": 256,
    "gen_batch_size": 40,
    "exit_layers": [2, 4, 6, 8, 10, 12, 15, 18],
    "prompt_context_tokens": 32,
    "store_dtype": "float16",
    "cache_dir": "data_cache/smollm2-135m",
    "num_threads": 1,
    "seed": 1234,
}

# Settings that change the content of shards; they enter the settings hash.
_HASHED_KEYS = ("temperature", "top_p", "max_new_tokens",
                "gen_batch_size", "exit_layers", "prompt_context_tokens", "store_dtype", "seed")


# ---------------------------------------------------------------------------
# config, data, model


def load_config(path: str | os.PathLike | None) -> dict:
    """Full YAML config with the ``collect`` section completed from the defaults."""
    cfg = {}
    if path is not None:
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
    cfg.setdefault("model", {})
    cfg["model"] = cfg["model"] or {}
    collect = dict(COLLECT_DEFAULTS)
    collect.update(cfg.get("collect") or {})
    unknown = set(collect) - set(COLLECT_DEFAULTS)
    if unknown:
        raise ValueError(f"Unknown collect settings: {sorted(unknown)}")
    cfg["collect"] = collect
    return cfg


def load_questions(path: str | os.PathLike, categories) -> list[dict]:
    """Questions of the given categories, in file order. Refuses evaluation categories."""
    categories = list(categories)
    bad = [c for c in categories if c not in TRAIN_CATEGORIES]
    if bad:
        raise ValueError(f"Categories {bad} are not in the train split {TRAIN_CATEGORIES}; "
                         f"{EVAL_CATEGORIES} are reserved for evaluation.")
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                if q["category"] in categories:
                    out.append(q)
    if not out:
        raise ValueError(f"No questions of categories {categories} in {path}")
    return out


def load_model(name_or_path: str | None, dtype="auto", device=None):
    """``(model, tokenizer)`` in eval mode, tokenizer with a pad token. dtype "auto": the checkpoint's own, or for
    the embedded SmolLM2 (its GGUF states none) bfloat16 where the device computes it fast, else float32."""
    from selfspec.models import load_default_model, resolve_model

    if name_or_path is None:
        model, tok = load_default_model(dtype=dtype, device=device)
    else:
        model, tok = resolve_model(name_or_path, dtype=dtype, device=device)
    model.eval()
    return model, tok


@torch.no_grad()
def model_fingerprint(model, name_or_path) -> dict:
    """Identify the weights: a hash over a few tensors of every parameter, plus shapes."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        h.update(name.encode())
        h.update(str(tuple(p.shape)).encode())
        k = min(4096, flat.numel())
        idx = torch.arange(k) * (flat.numel() - 1) // max(k - 1, 1)
        h.update(flat[idx].float().numpy().tobytes())
    cfg = model.config
    return {
        "name_or_path": name_or_path or "default (smollm2-135m)",
        "model_type": cfg.model_type,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "dtype": str(next(model.parameters()).dtype),
        "weights_sha256": h.hexdigest(),
    }


# ---------------------------------------------------------------------------
# jobs and batches


@dataclass
class Job:
    qid: int
    category: str
    turn: int
    chain: int
    messages: list
    prompt_ids: list | None = None

    @property
    def sampled(self) -> bool:
        return self.chain > 0


def turn_jobs(questions, turn: int, n_chains: int, answers: dict | None) -> list[Job]:
    """Jobs of one turn; turn 2 needs ``answers[(qid, chain)]`` = that chain's turn-1 text."""
    jobs = []
    for q in questions:
        if len(q["turns"]) < turn:
            continue
        for c in range(n_chains):
            msgs = []
            for t in range(turn - 1):
                msgs.append({"role": "user", "content": q["turns"][t]})
                msgs.append({"role": "assistant", "content": answers[(q["question_id"], c)]})
            msgs.append({"role": "user", "content": q["turns"][turn - 1]})
            jobs.append(Job(q["question_id"], q["category"], turn, c, msgs))
    return jobs


def encode_prompts(tok, jobs: list[Job]) -> None:
    for j in jobs:
        text = tok.apply_chat_template(j.messages, add_generation_prompt=True, tokenize=False)
        j.prompt_ids = tok(text, add_special_tokens=False)["input_ids"]


def plan_shards(jobs: list[Job], batch_size: int) -> list[tuple[str, list[Job]]]:
    """Split one turn's jobs into shards, one group per chain (greedy and sampled never share
    a call, as ``do_sample`` is per call; adding chains later only adds shards), each group
    sorted by prompt length so left padding stays small. Deterministic given the jobs."""
    shards = []
    for chain in sorted({j.chain for j in jobs}):
        group = sorted((j for j in jobs if j.chain == chain), key=lambda j: (len(j.prompt_ids), j.qid))
        for i in range(0, len(group), batch_size):
            shards.append((f"t{group[0].turn}-c{chain}-{i // batch_size:03d}", group[i:i + batch_size]))
    return shards


def shard_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little")


# ---------------------------------------------------------------------------
# generation and teacher forcing


def _eos_ids(model, tok) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return ids


class _Capture:
    """Forward hooks that keep, during ``generate``, what a teacher-forced pass would give:
    the input of each exit layer, the output of the final norm (both per forward call) and
    the argmax / max-probability of the LM head's raw logits at the last position."""

    def __init__(self, model, layers: list[int], keep_prompt: int, dtype: torch.dtype):
        self.layers, self.keep_prompt, self.dtype = layers, keep_prompt, dtype
        self.hidden = {e: [] for e in layers}
        self.final, self.top1, self.top1_prob = [], [], []
        backbone = model.get_decoder()
        self.handles = [backbone.layers[e].register_forward_pre_hook(self._pre(e), with_kwargs=True)
                        for e in layers]
        self.handles.append(backbone.norm.register_forward_hook(self._on_norm))
        self.handles.append(model.get_output_embeddings().register_forward_hook(self._on_head))

    def _tail(self, x: torch.Tensor) -> torch.Tensor:
        # prefill: only the last prompt columns are stored; copy so the big tensor can be freed
        return x[:, -self.keep_prompt:] if x.shape[1] > 1 else x

    # everything kept moves to the CPU at once: the shard is assembled and written there, and a CUDA run
    # keeps no growing list of activations on the device
    def _pre(self, e: int):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            self.hidden[e].append(self._tail(h).to(device="cpu", dtype=self.dtype, copy=True))
        return hook

    def _on_norm(self, module, args, out):
        # kept in the model's dtype: the LM head reads exactly these values
        self.final.append(self._tail(out).to(device="cpu", copy=True))

    def _on_head(self, module, args, out):
        prob, idx = torch.softmax(out[:, -1].float(), dim=-1).max(dim=-1)
        self.top1.append(idx.to(device="cpu", dtype=torch.int32))
        self.top1_prob.append(prob.cpu())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def generate_batch(model, tok, jobs: list[Job], c: dict, seed: int) -> tuple[list[list[int]], list[bool], dict]:
    """Generate the responses of one shard and gather its rows (see the module docstring).

    Responses are cut after the first eos; ``finished`` says whether each ended with eos.
    Hidden states come from the generation forward calls themselves (prefill for the prompt
    rows, decode step j + 1 for response token j), so no second pass is needed; the last token
    of each sequence is never fed back to the model and so has no row.
    """
    layers = [int(e) for e in c["exit_layers"]]
    keep = max(int(c["prompt_context_tokens"]), 1)  # the last prompt position predicts response token 0
    dtype = getattr(torch, c["store_dtype"])
    pad = tok.pad_token_id
    width = max(len(j.prompt_ids) for j in jobs)
    keep = min(keep, width)
    ids = torch.full((len(jobs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(jobs), width), dtype=torch.long)
    for r, j in enumerate(jobs):  # left padding
        ids[r, width - len(j.prompt_ids):] = torch.tensor(j.prompt_ids)
        mask[r, width - len(j.prompt_ids):] = 1
    sampled = jobs[0].sampled
    kw = dict(do_sample=True, temperature=float(c["temperature"]), top_p=float(c["top_p"]), top_k=0) \
        if sampled else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    torch.manual_seed(seed)
    cap = _Capture(model, layers, keep, dtype)
    device = next(model.parameters()).device
    try:
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=int(c["max_new_tokens"]), pad_token_id=pad, **kw)
    finally:
        cap.remove()
    n_steps = out.shape[1] - width
    if len(cap.final) != n_steps or len(cap.top1) != n_steps:
        raise RuntimeError(f"expected {n_steps} forward calls during generate, hooks saw {len(cap.final)}")

    eos = _eos_ids(model, tok)
    responses, finished = [], []
    for row in out[:, width:].cpu().tolist():
        cut = next((k for k, t in enumerate(row) if t in eos), None)
        responses.append(row if cut is None else row[:cut + 1])
        finished.append(cut is not None)

    # (B, keep, H) prompt tails and (B, n_steps - 1, H) decode steps, per stored tensor
    def split(calls):
        dec = torch.cat(calls[1:], dim=1) if n_steps > 1 else calls[0][:, :0]
        return calls[0], dec
    hid = {e: split(cap.hidden[e]) for e in layers}
    fin = split(cap.final)
    top1 = torch.stack(cap.top1, dim=1)  # (B, n_steps): column k = prediction after call k
    top1_prob = torch.stack(cap.top1_prob, dim=1)
    head = model.get_output_embeddings()

    cols: dict[str, list] = {k: [] for k in [f"hidden.{e}" for e in layers] + [
        "hidden.final", "input_ids", "target_ids", "positions", "is_response", "teacher_top1",
        "teacher_top1_prob"]}
    first_pos = []
    for r, (j, resp) in enumerate(zip(jobs, responses)):
        p, n_resp = len(j.prompt_ids), len(resp)
        lo = max(p - keep, 0)
        a, b = keep - p + lo, keep  # prompt rows lo..p-1 in the prefill tail
        for e in layers:
            cols[f"hidden.{e}"].append(torch.cat([hid[e][0][r, a:b], hid[e][1][r, :n_resp - 1]]))
        h_fin = torch.cat([fin[0][r, a:b], fin[1][r, :n_resp - 1]])
        cols["hidden.final"].append(h_fin.to(dtype))
        # teacher argmax: prompt rows except the last from the LM head here (in its own dtype and device, as the
        # model computed the others), the others from the hook
        pr = torch.softmax(head(h_fin[:p - 1 - lo].to(head.weight.device, head.weight.dtype)).float(),
                           dim=-1).max(dim=-1)
        pr = pr.values.cpu(), pr.indices.cpu()
        cols["teacher_top1"].append(torch.cat([pr[1].to(torch.int32), top1[r, :n_resp]]))
        cols["teacher_top1_prob"].append(torch.cat([pr[0], top1_prob[r, :n_resp]]))
        toks = torch.tensor(j.prompt_ids + resp, dtype=torch.int32)
        n = p + n_resp
        cols["input_ids"].append(toks[lo:n - 1])
        cols["target_ids"].append(toks[lo + 1:n])
        pos = torch.arange(lo, n - 1, dtype=torch.int32)
        cols["positions"].append(pos)
        cols["is_response"].append((pos >= p).to(torch.uint8))
        first_pos.append(lo)
    lens = [len(v) for v in cols["input_ids"]]
    tensors = {k: torch.cat(v).contiguous() for k, v in cols.items()}
    tensors["seq_offsets"] = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    tensors["seq_first_pos"] = torch.tensor(first_pos, dtype=torch.int32)
    return responses, finished, tensors


# ---------------------------------------------------------------------------
# shards and manifest


def read_shard_meta(path: Path) -> dict | None:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        return json.loads(meta["selfspec"])
    except Exception:  # unreadable / partial file: treat as missing
        return None


def settings_hash(c: dict, fingerprint: dict, questions_sha: str, question_ids: list) -> str:
    # samples_per_prompt is left out on purpose: chain c's shards do not depend on it, so a
    # cache can be extended with more chains later.
    blob = {k: c[k] for k in _HASHED_KEYS}
    blob.update(weights=fingerprint["weights_sha256"], questions=questions_sha, question_ids=question_ids,
                format=FORMAT_VERSION)
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def write_shard(path: Path, tensors: dict, meta: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"selfspec": json.dumps(meta)})
    os.replace(tmp, path)  # atomic: a crash never leaves a half shard under the final name


def write_manifest(cache: Path, cfg: dict, fingerprint: dict, shash: str, questions, shard_metas: list) -> dict:
    c = cfg["collect"]
    totals = {k: sum(m["stats"][k] for m in shard_metas)
              for k in ("n_seqs", "n_rows", "n_response_tokens", "gen_seconds")}
    totals["n_shards"] = len(shard_metas)
    totals["disk_bytes"] = sum((cache / m["file"]).stat().st_size for m in shard_metas)
    manifest = {
        "format_version": FORMAT_VERSION,
        "settings_hash": shash,
        "model": fingerprint,
        "exit_layers": [int(e) for e in c["exit_layers"]],
        "hidden_keys": [f"hidden.{e}" for e in c["exit_layers"]] + ["hidden.final"],
        "hidden_semantics": "hidden.E = hidden_states[E] = output of layers [0, E) (input of layer E); "
                            "hidden.final = last layer output after the final norm; "
                            "teacher logits = lm_head(hidden.final)",
        "store_dtype": c["store_dtype"],
        "collect": c,
        "seed": c["seed"],
        "split": {"train_categories": list(c["categories"]), "never_used": list(EVAL_CATEGORIES)},
        "question_ids": [q["question_id"] for q in questions],
        "totals": totals,
        "shards": [{"file": m["file"], "turn": m["turn"], "sampled": m["sampled"], **m["stats"]}
                   for m in shard_metas],
        "versions": {"torch": torch.__version__, "python": platform.python_version(),
                     "transformers": __import__("transformers").__version__},
    }
    tmp = cache / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, cache / "manifest.json")
    return manifest


def _log(msg: str) -> None:
    tqdm.write(f"[collect {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr)


def run_shard(model, tok, name: str, jobs: list[Job], c: dict, shash: str) -> tuple[dict, dict]:
    seed = shard_seed(int(c["seed"]), name)
    t0 = time.perf_counter()
    responses, finished, tensors = generate_batch(model, tok, jobs, c, seed)
    t1 = time.perf_counter()
    seqs = [j.prompt_ids + r for j, r in zip(jobs, responses)]
    prompt_lens = [len(j.prompt_ids) for j in jobs]
    tensors["seq_tokens"] = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
    tensors["seq_token_offsets"] = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int64).cumsum(0)
    tensors["seq_prompt_len"] = torch.tensor(prompt_lens, dtype=torch.int32)
    tensors["seq_qid"] = torch.tensor([j.qid for j in jobs], dtype=torch.int32)
    tensors["seq_turn"] = torch.tensor([j.turn for j in jobs], dtype=torch.int32)
    tensors["seq_chain"] = torch.tensor([j.chain for j in jobs], dtype=torch.int32)
    tensors["seq_finished"] = torch.tensor(finished, dtype=torch.int32)
    n_resp = sum(len(r) for r in responses)
    meta = {
        "format_version": FORMAT_VERSION,
        "settings_hash": shash,
        "name": name,
        "turn": jobs[0].turn,
        "sampled": jobs[0].sampled,
        "seed": seed,
        "seqs": [{"qid": j.qid, "category": j.category, "turn": j.turn, "chain": j.chain,
                  "prompt_len": len(j.prompt_ids), "n_response_tokens": len(r), "finished": f,
                  "response_text": tok.decode(r, skip_special_tokens=True).strip()}
                 for j, r, f in zip(jobs, responses, finished)],
        "stats": {"n_seqs": len(jobs), "n_rows": int(tensors["input_ids"].numel()),
                  "n_response_tokens": n_resp, "gen_seconds": round(t1 - t0, 2)},
    }
    return tensors, meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2-135m.yaml")
    ap.add_argument("--cache-dir", help="override collect.cache_dir")
    ap.add_argument("--device", default=None, help="cpu (default) or cuda")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                    help="model dtype; auto: bfloat16 where the device computes it fast, else float32")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (override collect.num_threads)")
    ap.add_argument("--max-new-tokens", type=int, help="override max_new_tokens")
    ap.add_argument("--gen-batch-size", type=int, help="override gen_batch_size")
    ap.add_argument("--overwrite", action="store_true", help="replace shards written with other settings")
    sb = ap.add_argument_group("specbench")
    sb.add_argument("--max-questions", type=int, help="only the first N train questions (dry runs)")
    sb.add_argument("--samples-per-prompt", type=int, help="override collect.samples_per_prompt")
    args = ap.parse_args(argv)

    cfg = load_config(args.config)
    return collect_specbench(args, cfg)


def collect_specbench(args, cfg: dict) -> int:
    c = cfg["collect"]
    for key in ("cache_dir", "samples_per_prompt", "max_new_tokens", "gen_batch_size"):
        if getattr(args, key) is not None:
            c[key] = getattr(args, key)
    if args.threads is not None:
        c["num_threads"] = args.threads
    torch.set_num_threads(int(c["num_threads"]))

    if not c["questions"]:
        from selfspec.prompts import spec_bench_path

        c["questions"] = str(spec_bench_path())
    questions = load_questions(c["questions"], c["categories"])
    if args.max_questions:
        questions = questions[:args.max_questions]
    with open(c["questions"], "rb") as f:
        questions_sha = hashlib.sha256(f.read()).hexdigest()
    cache = Path(c["cache_dir"])
    cache.mkdir(parents=True, exist_ok=True)

    t_load = time.perf_counter()
    name_or_path = (cfg.get("model") or {}).get("name_or_path")
    model, tok = load_model(name_or_path, dtype=args.dtype, device=args.device)
    n_layers = model.config.num_hidden_layers
    bad = [e for e in c["exit_layers"] if not 0 < int(e) < n_layers]
    if bad:
        raise ValueError(f"exit_layers {bad} outside (0, {n_layers})")
    fingerprint = model_fingerprint(model, name_or_path)
    shash = settings_hash(c, fingerprint, questions_sha, [q["question_id"] for q in questions])
    _log(f"model loaded in {time.perf_counter() - t_load:.1f}s; {len(questions)} questions, "
         f"{c['samples_per_prompt']} chains, turns {c['turns']}, settings {shash}, cache {cache}")

    metas, answers = [], {}
    t_start = time.perf_counter()
    new_tokens = 0
    for turn in sorted(int(t) for t in c["turns"]):
        if turn > 1 and any(t not in c["turns"] for t in range(1, turn)):
            raise ValueError(f"turn {turn} needs all earlier turns in collect.turns")
        jobs = turn_jobs(questions, turn, int(c["samples_per_prompt"]), answers)
        encode_prompts(tok, jobs)
        shards = plan_shards(jobs, int(c["gen_batch_size"]))
        bar = tqdm(shards, desc=f"turn {turn}", unit="shard", mininterval=5, file=sys.stderr)
        for name, sjobs in bar:
            path = cache / f"{name}.safetensors"
            meta = read_shard_meta(path) if path.exists() else None
            if meta is not None and meta.get("settings_hash") != shash and not args.overwrite:
                raise RuntimeError(f"{path} was written with other settings ({meta.get('settings_hash')} != "
                                   f"{shash}); use another --cache-dir or --overwrite")
            if meta is None or meta.get("settings_hash") != shash:
                tensors, meta = run_shard(model, tok, name, sjobs, c, shash)
                meta["file"] = path.name
                write_shard(path, tensors, meta)
                st = meta["stats"]
                new_tokens += st["n_response_tokens"]
                el = time.perf_counter() - t_start
                _log(f"{name}: {st['n_seqs']} seqs, {st['n_response_tokens']} resp tokens in "
                     f"{st['gen_seconds']:.0f}s ({st['n_response_tokens'] / max(st['gen_seconds'], 1e-9):.1f} tok/s); "
                     f"run total {new_tokens} tokens in {el:.0f}s "
                     f"({new_tokens / el:.1f} tok/s)")
            else:
                meta["file"] = path.name
            metas.append(meta)
            for s in meta["seqs"]:
                answers[(s["qid"], s["chain"])] = s["response_text"]
            manifest = write_manifest(cache, cfg, fingerprint, shash, questions, metas)
            bar.set_postfix(tokens=manifest["totals"]["n_response_tokens"])
        bar.close()
    tot = manifest["totals"]
    _log(f"done: {tot['n_shards']} shards, {tot['n_seqs']} seqs, {tot['n_response_tokens']} response tokens, "
         f"{tot['n_rows']} rows, {tot['disk_bytes'] / 2**20:.1f} MiB, {tot['gen_seconds']:.0f}s in shards -> "
         f"{tot['n_response_tokens'] / max(tot['gen_seconds'], 1e-9):.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
