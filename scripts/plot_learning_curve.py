"""Eval-split agreement of the exit heads against the ShareGPT tokens they were trained on, one line per design and
exit (the learning curve of the heads issue), from the results.json files `python -m train.eval_heads` wrote.

    python scripts/plot_learning_curve.py
"""
from __future__ import annotations

import argparse
import json

# the size part of a design name in the eval results -> assistant tokens in that ShareGPT snapshot
TOKENS = {"250k": 250_000, "880k": 880_000, "2.2M": 2_208_755, "2.8M": 2_208_755 + 597_138}
# designs whose eval results name them otherwise -> "sharegpt-<size>-<kind>" names
ALIASES = {"mix-u2": "sharegpt-2.8M-top-onpolicy"}
MT_BENCH_HEAD = ("mlp", 4, 64_000)  # the earlier head (design "mlp", exit 4), trained on MT-bench answers
RESULTS = ("bench_results/heads-eval-sharegpt-e4/results.json",
           "bench_results/heads-eval-sharegpt-e4-full/results.json",
           "bench_results/heads-eval-sharegpt-e2-e8-curve/results.json",
           "bench_results/heads-eval-sharegpt-e2-e8/results.json",
           "bench_results/heads-eval-sharegpt-e15/results.json",
           "bench_results/heads-eval-sharegpt-top-e2/results.json",
           "bench_results/heads-eval-sharegpt-top-e2-250k/results.json",
           "bench_results/heads-eval-sharegpt-top-e2-onpolicy-u2/results.json")


def agreement_by_design(paths) -> dict[tuple[str, int], float]:
    """(design, exit) -> eval-split agreement; a later file wins where two measured the same pair."""
    out = {}
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["replay"]:
                out[(ALIASES.get(row["design"], row["design"]), row["exit"])] = row["agreement"]
    return out


def curve_key(design: str, exit_layer: int) -> tuple[str, int] | None:
    """(line label, tokens) of a ShareGPT design ("sharegpt-<size>[-<suffix>]"), None for other designs."""
    parts = design.split("-")
    if parts[0] != "sharegpt" or parts[1] not in TOKENS:
        return None
    kind = "MLP reading the previous final state" if "top" in parts[2:] else "MLP"
    if "onpolicy" in parts[2:]:  # 597k of its tokens are the model's own answers, trained with --unroll 2
        kind += " + own answers, unroll 2"
    return f"{kind}, E={exit_layer}", TOKENS[parts[1]]


def curves(agreement: dict) -> dict[str, list[tuple[int, float]]]:
    lines: dict[str, list] = {}
    for (design, exit_layer), value in agreement.items():
        key = curve_key(design, exit_layer)
        if key is not None:
            lines.setdefault(key[0], []).append((key[1], 100 * value))
    return {label: sorted(points) for label, points in sorted(lines.items())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", nargs="+", default=list(RESULTS))
    p.add_argument("--output", default="bench_results/heads-learning-curve.png")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agreement = agreement_by_design(args.results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in curves(agreement).items():
        ax.plot([t for t, _ in points], [a for _, a in points], "o-", label=label)
        for tokens, value in points:
            print(f"{label:<40} {tokens:>9,} tokens: {value:.1f} %")
    design, exit_layer, tokens = MT_BENCH_HEAD
    if (design, exit_layer) in agreement:
        ax.plot([tokens], [100 * agreement[(design, exit_layer)]], "s", label=f"MLP, E={exit_layer}, MT-bench answers")
    ax.set_xscale("log")
    ax.set_xlabel("assistant tokens trained on")
    ax.set_ylabel("eval-split top-1 agreement (%)")
    ax.set_title("SmolLM2-135M exit heads on Spec-Bench's eval split")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
