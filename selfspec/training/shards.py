"""What collected data is made of: the collect config, the model's identity, shards and manifests.

Both sources of `train.collect` (collect.py) write safetensors shards with a JSON metadata record each, and a
manifest.json that sums them up. Shards are written atomically and carry their settings hash, so a rerun keeps
every shard of the same settings and refuses (or with --overwrite replaces) one of other settings.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
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
    "sharegpt": None,  # settings of --source sharegpt (SHAREGPT_DEFAULTS)
}

# Settings that change the content of shards; they enter the settings hash.
_HASHED_KEYS = ("temperature", "top_p", "max_new_tokens",
                "gen_batch_size", "exit_layers", "prompt_context_tokens", "store_dtype", "seed")


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


def shard_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little")


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
        **hidden_fields(c["exit_layers"]),
        "store_dtype": c["store_dtype"],
        "collect": c,
        "seed": c["seed"],
        "split": {"train_categories": list(c["categories"]), "never_used": list(EVAL_CATEGORIES)},
        "question_ids": [q["question_id"] for q in questions],
        "totals": totals,
        "shards": [{"file": m["file"], "turn": m["turn"], "sampled": m["sampled"], **m["stats"]}
                   for m in shard_metas],
        "versions": versions(),
    }
    return write_manifest_file(cache, manifest)


def load_checked_model(name_or_path, args, exit_layers):
    """(model, tokenizer, fingerprint), refusing exit layers the model does not have."""
    model, tok = load_model(name_or_path, dtype=args.dtype, device=args.device)
    n_layers = model.config.num_hidden_layers
    bad = [e for e in exit_layers if not 0 < int(e) < n_layers]
    if bad:
        raise ValueError(f"exit_layers {bad} outside (0, {n_layers})")
    return model, tok, model_fingerprint(model, name_or_path)


def hidden_fields(exit_layers) -> dict:
    """What a manifest says about the stored states, for both sources."""
    return {"exit_layers": [int(e) for e in exit_layers],
            "hidden_keys": [f"hidden.{e}" for e in exit_layers] + ["hidden.final"],
            "hidden_semantics": "hidden.E = hidden_states[E] = output of layers [0, E) (input of layer E); "
                                "hidden.final = last layer output after the final norm; "
                                "teacher logits = lm_head(hidden.final)"}


def versions() -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(),
            "transformers": __import__("transformers").__version__}


def write_manifest_file(cache: Path, manifest: dict) -> dict:
    """Write manifest.json atomically (a reader never sees half a file) and return it."""
    tmp = cache / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, cache / "manifest.json")
    return manifest


def log(msg: str) -> None:
    tqdm.write(f"[collect {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr)


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
