"""What `selfspec bench` writes: per-method summaries (Row), results.md, speedup.png and results.json."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .bench_methods import BASELINE, ORACLE
from .report import markdown_table
from .verdict import DIFFERS, NEAR_TIE

if TYPE_CHECKING:
    from .bench import BenchResult, Record

@dataclass
class Row:
    prompts: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float | None = None  # tokens/s over the baseline's
    mean_accepted: float | None = None  # tokens per full-model pass
    acceptance: float | None = None  # accepted / drafted
    oracle_fraction: float | None = None  # speedup / the oracle's speedup
    exact: int | None = None  # prompts identical to the baseline (None in sampling mode)
    near_tie: int | None = None  # prompts that part from it first at a near-tie of the plain model
    differs: int | None = None  # prompts that part from it where the plain model was sure: a bug
    rounds: int | None = None  # oracle: most runs any prompt needed until it drafted its own output


def _ratio(a, b):
    return a / b if a is not None and b else None


def aggregate(records: list[Record]) -> Row:
    tokens, seconds = sum(r.new_tokens for r in records), sum(r.seconds for r in records)
    known = [r for r in records if r.verify_steps is not None]
    steps = sum(r.verify_steps for r in known)
    drafted = sum(r.drafted or 0 for r in known)
    checked = not any(r.exact is None for r in records)
    exact = sum(len(r.question_ids) - len(r.mismatches) for r in records) if checked else None
    verdicts = [m["verdict"] for r in records for m in r.mismatches]
    rounds = [r.rounds for r in records if r.rounds is not None]
    return Row(prompts=sum(len(r.question_ids) for r in records), new_tokens=tokens, seconds=seconds,
               tokens_per_s=_ratio(tokens, seconds) or 0.0,
               mean_accepted=_ratio(sum(r.new_tokens for r in known), steps) if known else None,
               acceptance=_ratio(sum(r.accepted or 0 for r in known), drafted) if drafted else None,
               exact=exact, near_tie=verdicts.count(NEAR_TIE) if checked else None,
               differs=verdicts.count(DIFFERS) if checked else None, rounds=max(rounds) if rounds else None)


def summarize(records: list[Record], names: list[str], categories: list[str]) -> dict:
    """{category and "overall": {method: Row dict}}; tokens/s pools tokens and seconds over the prompts."""
    out = {}
    for category in [*categories, "overall"]:
        rows = {n: aggregate([r for r in records if r.method == n and category in ("overall", r.category)])
                for n in names}
        base = rows[BASELINE].tokens_per_s
        for row in rows.values():
            row.speedup = _ratio(row.tokens_per_s, base)
        oracle = rows[ORACLE].speedup if ORACLE in rows else None
        for row in rows.values():
            row.oracle_fraction = _ratio(row.speedup, oracle)
        out[category] = {n: asdict(r) for n, r in rows.items()}
    return out


def _sampling_words(settings: dict) -> str:
    top_p = settings.get("top_p", 1.0)  # results written before top-p was an option sampled without it
    return f"sampling, temperature {settings['temperature']}" + (f", top-p {top_p}" if top_p < 1 else "")


_FOLDED_WORDS = ", grouped-query attention folded in the engine (selfspec/attention.py)"


def render_markdown(result: BenchResult, meta: dict) -> str:
    setup, settings = result.setup, meta["settings"]
    ee = setup["hf_early_exit_layer"]
    tuned = ", ".join(f"E={k}: {v:.2f} tok/s" for k, v in setup["hf_early_exit_tuning_tokens_per_s"].items())
    lines = [
        f"# selfspec bench: {meta['model']['name']}",
        "",
        f"- command: `{meta['command']}`",
        f"- machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, torch threads: "
        f"{meta['machine']['torch_threads']}, device: {meta['machine']['device']}; load average (1/5/15 min) "
        f"{meta['machine']['loadavg_start']} at start, {meta['machine']['loadavg_end']} at end",
        f"- versions: torch {meta['versions']['torch']}, transformers {meta['versions']['transformers']}, "
        f"selfspec {meta['versions']['selfspec']}",
        f"- {_sampling_words(settings) if settings['sample'] else 'greedy'}, "
        f"max_new_tokens={settings['max_new_tokens']}, batch size {settings['batch_size']}, "
        f"{meta['model']['dtype']}, chat template {'on' if settings['chat_template'] else 'off'}"
        f"{_FOLDED_WORDS if meta['model'].get('folded_gqa') else ''}",
        f"- selfspec: exit layer {setup['selfspec_config']['exit_layer']} of {setup['num_layers']}, "
        f"max_draft_tokens={setup['selfspec_config']['max_draft_tokens']}, heads: {setup['heads_source']}",
    ]
    for name, phrase in setup.get("engine_settings", {}).items():
        lines.append(f"- {name}: {phrase}")
    if ee is not None:
        lines.append(f"- hf-early-exit: E={ee}, the fastest of [{tuned}] on train-split prompts")
    if "hf-prompt-lookup" in result.names:
        lines.append(f"- hf-prompt-lookup: N={settings['prompt_lookup_tokens']}")
    for name, why in setup["skipped_methods"].items():
        lines.append(f"- skipped {name}: {why}")
    lines.append(f"- wall time {result.wall_seconds / 60:.1f} min (model load excluded)")
    if result.stopped:
        lines.append(f"- **{result.stopped}**: the tables cover the prompts that every method finished")
    lines.append(exactness_line(result))
    for category, rows in [("overall", result.summary["overall"])] + [
            (c, r) for c, r in result.summary.items() if c != "overall"]:
        n = next(iter(rows.values()))["prompts"]
        lines += ["", f"## {category} ({n} prompts)", "", markdown_table(rows)]
    lines += ["", "speedup = tokens/s over hf-greedy's (tokens and seconds pooled over the prompts); mean accepted "
              "= tokens per full-model pass (prefill included); acceptance = accepted / drafted tokens; of oracle "
              "= speedup / the oracle's speedup; identical = prompts whose output equals hf-greedy's token for token, "
              "near-tie = prompts that first part from it where the plain model's top-two logit gap is within its own "
              "1-token vs multi-token rounding discrepancy (half precision), differs = any other divergence (a bug)."]
    return "\n".join(lines) + "\n"


def exactness_line(result: BenchResult) -> str:
    if result.records and result.records[0].exact is None:
        return "- exactness: not checked in sampling mode (speed and acceptance only)"
    if not result.mismatches:
        return "- exactness: every method's output equals hf-greedy's on every prompt"
    bad = sorted({(m["method"], str(m["question_id"])) for m in result.mismatches if m["verdict"] == DIFFERS})
    ties = sum(m["verdict"] == NEAR_TIE for m in result.mismatches)
    line = f"- exactness: {ties} output(s) part from hf-greedy at a near-tie of the plain model (half-precision rounding)"
    if bad:
        line += f"; **{len(bad)} DIFFER(S)** where the model was sure: " + ", ".join(f"{m} on {q}" for m, q in bad)
    return line + (", none differs" if not bad else "")


def plot_speedup(summary: dict, names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [c for c in summary if c != "overall"] + ["overall"]
    shown = [n for n in names if n != BASELINE]
    width = 0.8 / max(len(shown), 1)
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups) + 2), 4.5))
    for i, name in enumerate(shown):
        values = [summary[g][name]["speedup"] or 0.0 for g in groups]
        ax.bar([x + (i - (len(shown) - 1) / 2) * width for x in range(len(groups))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(f"speedup over {BASELINE} (tokens/s ratio)")
    ax.set_title("selfspec bench: speedup per category")
    ax.legend(fontsize=8, ncols=min(4, len(shown)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(result: BenchResult, meta: dict, directory: str | Path) -> dict[str, Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"json": directory / "results.json", "md": directory / "results.md", "png": directory / "speedup.png"}
    payload = {"meta": meta, "setup": result.setup, "wall_seconds": result.wall_seconds, "stopped": result.stopped,
               "mismatches": result.mismatches, "summary": result.summary,
               "records": [asdict(r) for r in result.records]}
    paths["json"].write_text(json.dumps(payload, indent=1, default=str) + "\n")
    paths["md"].write_text(render_markdown(result, meta))
    plot_speedup(result.summary, result.names, paths["png"])
    return paths
