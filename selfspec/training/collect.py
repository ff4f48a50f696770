"""Collect self-distillation data for early-exit heads.

    python -m train.collect --config configs/smollm2-135m.yaml [--max-questions 4] [--cache-dir DIR]
    python -m train.collect --source sharegpt [--target-tokens N] [--device cuda] [--cache-dir DIR]

Two sources, same shard format (below), each in its own cache directory:

``--source specbench`` (default, section ``collect``) is described from the next paragraph on.

``--source sharegpt`` (section ``collect.sharegpt``; the data comes with ``pip install 'selfspec[train]'``):
ShareGPT conversations teacher-forced (``tf-*`` shards) plus the model's own answers to a share of their first
turns (``op-*`` shards), every conversation holding a Spec-Bench turn dropped; sharegpt.py has the details.

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
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .answers import encode_prompts, plan_shards, run_shard, turn_jobs
from .sharegpt import collect_sharegpt
from .shards import load_checked_model, load_config, load_questions, log, read_shard_meta, settings_hash, \
    write_manifest, write_shard


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
    log(f"model loaded in {time.perf_counter() - t_load:.1f}s; {len(questions)} questions, "
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
                log(f"{name}: {st['n_seqs']} seqs, {st['n_response_tokens']} resp tokens in "
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
    log(f"done: {tot['n_shards']} shards, {tot['n_seqs']} seqs, {tot['n_response_tokens']} response tokens, "
         f"{tot['n_rows']} rows, {tot['disk_bytes'] / 2**20:.1f} MiB, {tot['gen_seconds']:.0f}s in shards -> "
         f"{tot['n_response_tokens'] / max(tot['gen_seconds'], 1e-9):.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
