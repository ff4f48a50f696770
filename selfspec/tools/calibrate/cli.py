"""`selfspec calibrate` (and `python -m selfspec.calibrate`): the command line around `study.calibrate`."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

from ...wrap import unwrap, wrap
from .space import SearchSpec, default_space_path, describe, load_search_spec
from .study import _ensure_wrapped, calibrate
from .trials import encode_turns, load_calibration_prompts


def parse_args(argv) -> argparse.Namespace:
    description = sys.modules[__package__].__doc__.split("\n\n")[0]  # the package's first paragraph
    p = argparse.ArgumentParser(prog="selfspec calibrate", description=description)
    p.add_argument("--model", default="smollm2-135m", help="known name, local HF directory or hub id")
    p.add_argument("--heads", nargs="+", metavar="DIR",
                   help="directory with trained exit heads (and a selfspec config) to calibrate; several (for "
                        "example an `mlp` and a `fused` set) are calibrated one after another on the same prompts, "
                        "each in OUTPUT/heads-N, and the fastest one's config and heads are written to OUTPUT")
    p.add_argument("--prompts", help="Spec-Bench JSONL (turns, chat template) or text file, one prompt a line;"
                                     " default: Spec-Bench's MT-bench categories (the train split)")
    p.add_argument("--trials", type=int, help="measured trials in this run (default 20 without --timeout)")
    p.add_argument("--timeout", type=float, help="search budget in seconds (setup and final re-timing extra)")
    p.add_argument("--time-budget", type=float, help="seconds for the whole run, setup and final re-timing included: "
                   "prompts, tokens and re-timing shrink to fit (calibrate/budget.py), the search gets the rest")
    p.add_argument("--storage", help="Optuna storage URL (default sqlite:///OUTPUT/study.db)")
    p.add_argument("--study-name", help="default: model-heads-device-dtype")
    p.add_argument("--output", help="where config, report and study go (default: --heads when one, else "
                                    "calibration/MODEL)")
    p.add_argument("--space", help="search space: a YAML file or a shipped space's name (default: the shipped "
                                   "space for MODEL, else 'default'; see selfspec/tools/calibrate/search_spaces/)")
    p.add_argument("--max-prompts", type=int, help="override measure.max_prompts")
    p.add_argument("--max-new-tokens", type=int, help="override measure.max_new_tokens")
    p.add_argument("--turns", type=int, nargs="+", choices=[1, 2],
                   help="override measure.turns: 1 times first user turns, 2 second turns after the model's own "
                        "answer to the first (as Spec-Bench runs MT-bench), 1 2 both")
    p.add_argument("--sample", action="store_true", default=None,
                   help="time sampled generation instead of greedy (measure.sample): sampling accepts fewer drafts, "
                        "so its fastest setting differs")
    p.add_argument("--temperature", type=float, help="override measure.temperature, with --sample")
    p.add_argument("--top-p", type=float, help="override measure.top_p, with --sample")
    p.add_argument("--seed", type=int, help="override measure.seed, with --sample")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="model precision; auto = the checkpoint's dtype, or for the embedded model bfloat16 where "
                        "the device computes it in hardware, else float32 (default: auto)")
    p.add_argument("--threads", type=int, help="torch intra-op threads on CPU")
    p.add_argument("--compile", action="store_true", help="trials run compiled (selfspec/compiled.py), and so does "
                   "the config written; the compile time of each new pass shape is left out of the timings")
    return p.parse_args(argv)


def _load_spec(args) -> SearchSpec:
    path = args.space or default_space_path(args.model)
    spec = load_search_spec(path) if path else SearchSpec()
    if args.max_prompts is not None:
        spec.measure.max_prompts = args.max_prompts
    if args.max_new_tokens is not None:
        spec.measure.max_new_tokens = args.max_new_tokens
    if args.turns is not None:
        spec.measure = dataclasses.replace(spec.measure, turns=list(args.turns))  # checked again
    if spec.measure.max_prompts < 1 or spec.measure.max_new_tokens < 2:
        raise ValueError("measure.max_prompts must be >= 1 and measure.max_new_tokens >= 2.")
    sampling = {"sample": args.sample, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
    given = {k: v for k, v in sampling.items() if v is not None}
    if given and not (given.get("sample") or spec.measure.sample):
        raise ValueError(f"--{next(iter(given)).replace('_', '-')} sets how sampled trials sample; add --sample "
                         f"(or measure.sample: true in the space file).")
    spec.measure = dataclasses.replace(spec.measure, **given)  # checks temperature and top-p again
    return spec


def _load_model(args):
    from ...models import resolve_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # the plain baseline is this same model object unwrapped, so it always runs in the wrapped model's dtype
    model, tokenizer = resolve_model(args.model, dtype=args.dtype, device=device)
    return model, tokenizer


def _attach(model, heads: str | None, compile: bool) -> None:
    """Wrap `model` with `heads` (its config and heads, as save_pretrained wrote them), replacing what it had."""
    if getattr(model, "selfspec", None) is not None:
        unwrap(model)
    if heads:
        wrap(model, heads)
    if compile:
        _ensure_wrapped(model)
        model.selfspec.config = model.selfspec.config.replace(compile=True)


# kinds of drafting a shipped space holds at the most (chains and trees of early_exit and hybrid, n-grams): the
# re-timing's size is bounded with it before the space is resolved against the model (the study uses the real count)
MOST_KINDS = 5


def fit_to_budget(spec: SearchSpec, model, tokenizer, questions, seconds: float) -> tuple[SearchSpec, str]:
    """`spec` with its measurement and re-timing shrunk to fit `seconds` (budget.fit), at the speed of plain
    generate timed here on the first question; and what was cut, in words."""
    from ...prompts import chat_input_ids
    from .budget import fit
    from .trials import generate_once, time_generation

    ids = chat_input_ids(tokenizer, questions[0].text).to(next(model.parameters()).device)
    generate_once(model, ids, 2, plain=True)  # first calls are slow
    probe = time_generation(model, [ids], 16, plain=True)
    fitted = fit(spec.measure, spec.search, seconds, 1.0 / probe.tokens_per_s, kinds=MOST_KINDS)
    print(f"calibrate: time budget {seconds:.0f} s at {probe.tokens_per_s:.1f} plain tok/s"
          + (f": {fitted.cut}" if fitted.cut else ""), flush=True)
    return dataclasses.replace(spec, measure=fitted.measure, search=fitted.strategy), fitted.cut


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # --time-budget counts from here
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.time_budget is not None and args.time_budget <= 0:
        raise ValueError(f"--time-budget must be > 0 seconds, got {args.time_budget}.")
    if args.heads and len(args.heads) > 1 and (args.study_name or args.storage):
        raise ValueError(f"--{'study-name' if args.study_name else 'storage'} names one study, and several --heads "
                         "run one each: leave it out (each one's study is OUTPUT/heads-N/study.db).")
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = _load_spec(args)
    model, tokenizer = _load_model(args)
    _attach(model, args.heads[0] if args.heads else None, args.compile)  # a bad directory stops before any timing
    questions = load_calibration_prompts(args.prompts, spec.measure.max_prompts)
    cut, deadline = "", None
    if args.time_budget:
        deadline = started + args.time_budget
        spec, cut = fit_to_budget(spec, model, tokenizer, questions, deadline - time.monotonic())
        questions = load_calibration_prompts(args.prompts, spec.measure.max_prompts)
    prompts = encode_turns(model, tokenizer, questions, spec.measure, next(model.parameters()).device)
    heads = args.heads or [None]
    output = args.output or (heads[0] if len(heads) == 1 else None) or os.path.join("calibration",
                                                                                     Path(str(args.model)).name)
    results = []
    for i, directory in enumerate(heads):
        if i:
            _attach(model, directory, args.compile)
        # each heads directory gets an equal share of what is left of the budget, and of --timeout
        share = None if deadline is None else time.monotonic() + (deadline - time.monotonic()) / (len(heads) - i)
        where = output if len(heads) == 1 else os.path.join(output, f"heads-{i + 1}")
        if len(heads) > 1:
            print(f"calibrate: heads {i + 1} of {len(heads)}: {directory}", flush=True)
        result = calibrate(model, prompts, spec, storage=args.storage, output=where, study_name=args.study_name,
                           trials=args.trials, timeout=args.timeout and args.timeout / len(heads),
                           model_name=str(args.model), deadline=share, cut=cut)
        results.append((directory, where, sorted({h.kind for h in model.selfspec.heads.values()}), result))
        print(f"best {describe(result.report['confirmed'][0]['params'])}: {result.best_tokens_per_s:.2f} tok/s, "
              f"plain {result.plain_tokens_per_s:.2f} tok/s, x{result.speedup:.2f}; config and report in {where}"
              + (" (slower than plain: the config drafts nothing)" if result.report["drafts_nothing_instead"]
                 else ""))
    if len(heads) > 1:
        write_fastest(model, results, output, args.compile)
    return 0


def write_fastest(model, results: list, output: str, compile: bool) -> None:
    """Several heads directories calibrated: the config and heads of the fastest against plain `generate` (each
    study times plain `generate` beside its best) into `output`, with heads.json naming every one's result."""
    import json

    rows = [{"heads": directory, "kinds": kinds, "calibrated": where, "speedup": result.speedup,
             "best": describe(result.report["confirmed"][0]["params"])}
            for directory, where, kinds, result in results]
    winner = max(range(len(rows)), key=lambda i: rows[i]["speedup"])
    _attach(model, rows[winner]["calibrated"], compile)
    with torch.no_grad():  # the base model's fingerprint reads its weights
        model.selfspec.save_pretrained(output)
    Path(output, "heads.json").write_text(json.dumps({"fastest": winner + 1, "compared": rows}, indent=2) + "\n")
    for i, row in enumerate(rows):
        print(f"calibrate: heads {i + 1} ({', '.join(row['kinds']) or 'none'}, {row['heads']}): x{row['speedup']:.2f}"
              + (" <- fastest: its config and heads are in " + output if i == winner else ""))
