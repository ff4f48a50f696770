"""vLLM with and without selfspec's drafters, side by side (run it in the vLLM environment, docs/serving.md).

    python -m selfspec.serving.vllm_bench --draft DIR --limit 4 --output OUT

DIR is what `selfspec export-vllm` wrote (it names the target). Methods, each in a vLLM engine of its own:

    vllm             no speculation: the reference every output is compared with
    vllm-ngram-N     vLLM's own prompt lookup (`method: ngram`, n-grams 1..3), drafting N tokens
    selfspec-ngram-N selfspec's prompt lookup as vLLM's `custom_class` proposer (vllm_ngram.py), drafting N tokens
    selfspec-heads   the exported exit head as vLLM's EAGLE draft model (vllm_draft.py); with several --draft
                     directories (an mlp and a fused head, say) one row each: selfspec-heads, selfspec-heads-2, ...

The lookups run at every length of `--ngram-tokens` (2, 4 and 8 by default), and the report names each lookup's
fastest length per load: a drafter is compared with a lookup at its best, not at one setting.

Every method decodes the eval split's prompts greedily, first one request at a time, then `--concurrency` at once
(vLLM's own scheduler batches them). Where an output parts from the reference, the verdict is selfspec's rule
(tools/verdict.py) on vLLM's own numbers: at the first differing token, the gap between the two tokens in the
reference's 1-token pass against how far a multi-token pass over the same prefix moves the logits, both read
from vLLM's top-20 log-probabilities relative to the reference token (so the normaliser cancels).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..tools.verdict import decide, first_difference

TOP = 20  # log-probabilities vLLM returns per position for the verdict


LOOKUPS = ("vllm-ngram", "selfspec-ngram")  # the methods measured at each --ngram-tokens length


def method_specs(draft: dict | list[dict], ngram_tokens=(2, 4, 8)) -> dict[str, dict | None]:
    """Method name -> vLLM speculative_config (None: no speculation); a lookup gets one row per draft length, and
    each exported head (selfspec_vllm.json of each --draft) one row: selfspec-heads, selfspec-heads-2, ..."""
    specs = {"vllm": None}
    for n in ngram_tokens:
        specs[f"vllm-ngram-{n}"] = {"method": "ngram", "num_speculative_tokens": n, "prompt_lookup_max": 3,
                                    "prompt_lookup_min": 1}
    for n in ngram_tokens:
        specs[f"selfspec-ngram-{n}"] = {"method": "custom_class", "num_speculative_tokens": n,
                                        "model": "selfspec.serving.vllm_ngram.NgramProposer"}
    for i, one in enumerate([draft] if isinstance(draft, dict) else draft):
        specs[heads_row(i)] = {"method": "eagle", "model": one["directory"],
                               "num_speculative_tokens": one["num_speculative_tokens"]}
    return specs


def heads_row(i: int) -> str:
    """The row of the i-th exported head: the first is selfspec-heads, as with one --draft."""
    return "selfspec-heads" if i == 0 else f"selfspec-heads-{i + 1}"


def expand(methods: list[str], ngram_tokens, drafts: int = 1) -> list[str]:
    """The rows of the chosen methods: each lookup at every draft length, selfspec-heads once per draft, the others
    as named."""
    def rows(m):
        if m in LOOKUPS:
            return [f"{m}-{n}" for n in ngram_tokens]
        return [heads_row(i) for i in range(drafts)] if m == "selfspec-heads" else [m]

    return [row for m in methods for row in rows(m)]


def best_lookups(table: dict) -> dict:
    """{lookup: {mode: its fastest row}} among a results table's rows of each lookup."""
    best = {}
    for family in LOOKUPS:
        rows = [name for name in table if name.startswith(f"{family}-") and name.removeprefix(f"{family}-").isdigit()]
        if rows:
            best[family] = {mode: max(rows, key=lambda name: table[name][mode]["tokens_per_s"])
                            for mode in ("one", "many")}
    return best


def workload(target: str, limit: int | None, categories: list[str] | None = None) -> tuple[list[dict], list[int]]:
    """The eval split's prompts as token ids (chat template), and one training-split prompt to warm up on."""
    from transformers import AutoTokenizer

    from ..prompts import chat_input_ids, load_prompts

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [{"category": p.category, "question_id": p.question_id,
                "ids": chat_input_ids(tokenizer, p.text)[0].tolist()}
               for p in load_prompts(split="eval", categories=categories, limit_per_category=limit)]
    warmup = chat_input_ids(tokenizer, load_prompts(split="train", limit_per_category=1)[0].text)[0].tolist()
    return prompts, warmup


def _spec_counts(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters (drafts, drafted and accepted tokens)."""
    counts = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counts[metric.name.removeprefix("vllm:spec_decode_num_")] = metric.value
    return counts


def _per_draft(before: dict, after: dict, counter: str) -> float | None:
    """A counter's growth per draft between two readings of _spec_counts (None: nothing was drafted)."""
    drafts = after.get("drafts", 0) - before.get("drafts", 0)
    return (after.get(counter, 0) - before.get(counter, 0)) / drafts if drafts else None


def run_method(args) -> dict:
    """One engine: warm up, then the prompts one at a time, then all of them at `concurrency`."""
    from vllm import LLM, SamplingParams

    prompts, warmup = workload(args.target, args.limit, args.categories)
    spec = json.loads(args.spec) if args.spec else None
    llm = LLM(model=args.target, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
              speculative_config=spec, max_num_seqs=max(args.concurrency, 1), enable_prefix_caching=False,
              disable_log_stats=False, enforce_eager=args.enforce_eager)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    llm.generate([{"prompt_token_ids": warmup}], params, use_tqdm=False)
    result = {}
    for mode, group in (("one", 1), ("many", args.concurrency)):
        before, outputs, start = _spec_counts(llm), [], time.perf_counter()
        for i in range(0, len(prompts), group):
            done = llm.generate([{"prompt_token_ids": p["ids"]} for p in prompts[i: i + group]] if group == 1 else
                                [{"prompt_token_ids": p["ids"]} for p in prompts], params, use_tqdm=False)
            outputs += [list(o.outputs[0].token_ids) for o in done]
            if group != 1:
                break
        seconds, after = time.perf_counter() - start, _spec_counts(llm)
        accepted = _per_draft(before, after, "accepted_tokens")
        result[mode] = {"outputs": outputs, "seconds": seconds, "tokens": sum(map(len, outputs)),
                        "mean_accepted": None if accepted is None else 1 + accepted,  # per step, with the target's
                        "mean_drafted": _per_draft(before, after, "draft_tokens")}
    return result


def _relative(logprobs: dict, token: int) -> dict[int, float]:
    """{token id: log-probability} relative to `token`'s (the normaliser cancels)."""
    base = logprobs[token]
    return {t: lp - base for t, lp in logprobs.items()}


def judge_divergences(args) -> list[dict]:
    """Verdicts for the divergences in --judge (a JSON list of {prompt, want, got}), from the reference engine."""
    from vllm import LLM, SamplingParams

    cases = json.loads(Path(args.judge).read_text())
    llm = LLM(model=args.target, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager)

    def top(prompt: list[int], steps: int) -> list[dict[int, float]]:
        params = SamplingParams(temperature=0.0, max_tokens=steps, logprobs=TOP)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        return [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]

    verdicts = []
    for case in cases:
        i, want, got = case["index"], case["want"], case["got"]
        if i >= len(want) or i >= len(got):
            verdicts.append({**case, "kind": "differs", "why": "one output ended where the other went on"})
            continue
        a, b = want[i], got[i]
        one = top(case["prompt"], i + 1)[i]  # the reference's own 1-token pass at i
        many = top(case["prompt"] + want[:i], 1)[0]  # one pass over the whole prefix
        if a not in one or a not in many:
            verdicts.append({**case, "kind": "differs", "why": "the reference token is not vLLM's top choice there"})
            continue
        rel_one, rel_many = _relative(one, a), _relative(many, a)
        shared = rel_one.keys() & rel_many.keys()
        discrepancy = max(abs(rel_one[t] - rel_many[t]) for t in shared)
        if b not in rel_one:
            verdicts.append({**case, "kind": "differs", "gap": None, "discrepancy": discrepancy,
                             "why": f"the drafted output's token is outside the reference's top {TOP}"})
            continue
        gap = -rel_one[b]
        kind = decide(gap, discrepancy)
        verdicts.append({**case, "kind": kind, "gap": gap, "discrepancy": discrepancy,
                         "why": f"gap {gap:.3f} {'<=' if kind == 'near-tie' else '>'} 2 x rounding {discrepancy:.3f}"})
    return verdicts


def _child(args, out: Path, **extra) -> dict:
    """Run this module in a fresh process (one vLLM engine per process) and read what it wrote."""
    command = [sys.executable, "-m", "selfspec.serving.vllm_bench", "--target", args.target, "--dtype", args.dtype,
               "--max-new-tokens", str(args.max_new_tokens), "--concurrency", str(args.concurrency),
               "--max-model-len", str(args.max_model_len), "--child-output", str(out)]
    if args.limit is not None:
        command += ["--limit", str(args.limit)]
    if args.enforce_eager:
        command.append("--enforce-eager")
    if args.categories:
        command += ["--categories", *args.categories]
    for key, value in extra.items():
        command += [f"--{key.replace('_', '-')}", value]
    log = out.with_suffix(".log")
    with log.open("w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed (exit {done.returncode}); its log: {log}")
    return json.loads(out.read_text())


def compare(args) -> dict:
    drafts = [json.loads((Path(d) / "selfspec_vllm.json").read_text()) for d in args.draft]
    targets = {d["target"] for d in drafts}
    if len(targets) > 1 and not args.target:
        raise SystemExit(f"--draft directories name different targets ({', '.join(sorted(targets))}): export them "
                         "for one model, or pass --target.")
    args.target = args.target or drafts[0]["target"]
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = method_specs(drafts, args.ngram_tokens)
    runs = {}
    for name in expand(args.methods, args.ngram_tokens, len(drafts)):
        print(f"{name} ...", flush=True)
        runs[name] = _child(args, out_dir / f"{name}.json", spec=json.dumps(specs[name]) if specs[name] else "")
    prompts, _ = workload(args.target, args.limit, args.categories)
    reference = runs["vllm"]
    cases = []
    for name, run in runs.items():
        for mode in ("one", "many"):
            for p, got, want in zip(prompts, run[mode]["outputs"], reference[mode]["outputs"]):
                i = first_difference(got, want)
                if i is not None and name != "vllm":
                    cases.append({"method": name, "mode": mode, "question_id": p["question_id"],
                                  "prompt": p["ids"], "index": i, "want": want, "got": got})
    verdicts = []
    if cases:
        (out_dir / "divergences.json").write_text(json.dumps(cases))
        verdicts = _child(args, out_dir / "verdicts.json", judge=str(out_dir / "divergences.json"))
    plain = {mode: reference[mode]["tokens"] / reference[mode]["seconds"] for mode in ("one", "many")}
    table = {}
    for name, run in runs.items():
        row = {}
        for mode in ("one", "many"):
            mine = [v for v in verdicts if v["method"] == name and v["mode"] == mode]
            rate = run[mode]["tokens"] / run[mode]["seconds"]
            row[mode] = {"tokens_per_s": rate, "speedup": rate / plain[mode],
                         "mean_accepted": run[mode]["mean_accepted"], "mean_drafted": run[mode].get("mean_drafted"),
                         "identical": len(prompts) - len(mine),
                         "near_tie": sum(v["kind"] == "near-tie" for v in mine),
                         "differs": sum(v["kind"] == "differs" for v in mine)}
        table[name] = row
    import vllm

    results = {"command": " ".join(["python -m selfspec.serving.vllm_bench"] + sys.argv[1:]),
               "vllm": vllm.__version__, "target": args.target, "drafts": [d["directory"] for d in drafts],
               "dtype": args.dtype, "prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency,
               "threads": os.environ.get("OMP_NUM_THREADS"), "methods": table, "best": best_lookups(table),
               "verdicts": [{k: v for k, v in d.items() if k not in ("prompt", "want", "got")} for d in verdicts]}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(report(results))
    return results


def report(results: dict) -> str:
    """The markdown table of one results.json."""
    n = results["concurrency"]
    lines = [f"- run: vLLM {results['vllm']}, {results['dtype']}, greedy, {results['prompts']} prompts, "
             f"{results['max_new_tokens']} new tokens, OMP_NUM_THREADS={results['threads']}",
             f"- command: `{results['command']}`",
             "",
             f"| method | 1 request: tok/s | speedup | drafted / emitted per step | identical / near-tie / differs "
             f"| {n} at once: tok/s | speedup | identical / near-tie / differs |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | --- |"]
    for name, row in results["methods"].items():
        one, many = row["one"], row["many"]
        accepted = ("–" if one["mean_accepted"] is None else
                    f"{one.get('mean_drafted') or 0:.2f} / {one['mean_accepted']:.2f}")
        lines.append(f"| {name} | {one['tokens_per_s']:.1f} | {one['speedup']:.2f}x | {accepted} | "
                     f"{one['identical']} / {one['near_tie']} / {one['differs']} | {many['tokens_per_s']:.1f} | "
                     f"{many['speedup']:.2f}x | {many['identical']} / {many['near_tie']} / {many['differs']} |")
    table, best = results["methods"], results.get("best") or {}
    if best:
        lines.append("")
    for family, rows in best.items():
        words = [f"{'1 request' if mode == 'one' else f'{n} at once'}: {row} ({table[row][mode]['speedup']:.2f}x)"
                 for mode, row in rows.items()]
        line = f"- fastest {family}: " + ", ".join(words)
        for heads in [name for name in table if name.startswith("selfspec-heads")]:
            line += f"; {heads} against it: " + ", ".join(
                f"{table[heads][mode]['tokens_per_s'] / table[row][mode]['tokens_per_s']:.2f}x"
                for mode, row in rows.items())
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m selfspec.serving.vllm_bench", description=__doc__.split("\n")[0])
    p.add_argument("--draft", nargs="+", help="the directory `selfspec export-vllm` wrote; several (heads of one "
                   "model) run side by side, as rows selfspec-heads, selfspec-heads-2, ...")
    p.add_argument("--target", help="the model vLLM serves (default: the one the draft directory names)")
    p.add_argument("--methods", nargs="+", default=["vllm", "vllm-ngram", "selfspec-ngram", "selfspec-heads"],
                   choices=["vllm", "vllm-ngram", "selfspec-ngram", "selfspec-heads"],
                   help="what to compare; vllm (the reference) is always run first")
    p.add_argument("--ngram-tokens", type=int, nargs="+", default=[2, 4, 8],
                   help="draft lengths the lookups run at, one row each (default: 2 4 8)")
    p.add_argument("--limit", type=int, default=4, help="prompts per eval category (default 4: 20 prompts)")
    p.add_argument("--categories", nargs="+", help="eval categories to run (default: all five)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8, help="requests at once in the second pass")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile: each engine starts in "
                   "seconds instead of about a minute, for checks of outputs and acceptance, not for timings")
    p.add_argument("--output", default="vllm-bench", help="folder for results.json and each engine's log")
    p.add_argument("--report", metavar="RESULTS_JSON", help="print the table of a results.json and stop")
    p.add_argument("--spec", help=argparse.SUPPRESS)  # child: this engine's speculative_config (JSON)
    p.add_argument("--judge", help=argparse.SUPPRESS)  # child: judge these divergences
    p.add_argument("--child-output", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return
    if args.child_output:
        result = judge_divergences(args) if args.judge else run_method(args)
        Path(args.child_output).write_text(json.dumps(result))
        return
    if not args.draft:
        p.error("--draft DIR is needed: the directory `selfspec export-vllm` wrote")
    args.methods = ["vllm"] + [m for m in args.methods if m != "vllm"]
    compare(args)


if __name__ == "__main__":
    main()
