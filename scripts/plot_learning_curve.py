"""Eval-split agreement of the E=4 MLP heads against the ShareGPT tokens they were trained on (the learning curve of
the heads issue), from the results.json files `python -m train.eval_heads` wrote.

    python scripts/plot_learning_curve.py --output bench_results/heads-eval-sharegpt-e4-full/learning_curve.png
"""
from __future__ import annotations

import argparse
import json

# design name in the eval results -> assistant tokens its head was trained on (README, "ShareGPT self-distillation")
TOKENS = {"sharegpt-250k": 250_000, "sharegpt-880k": 880_000, "sharegpt-2.2M": 2_208_755}
MT_BENCH_HEAD = ("mlp", 64_000)  # the earlier head, trained on the model's answers to MT-bench questions
RESULTS = ("bench_results/heads-eval-sharegpt-e4/results.json", "bench_results/heads-eval-sharegpt-e4-full/results.json")


def agreement_by_design(paths) -> dict[str, float]:
    """design -> eval-split agreement at exit 4; a later file wins where two measured the same design."""
    out = {}
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["replay"]:
                if row["exit"] == 4:
                    out[row["design"]] = row["agreement"]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", nargs="+", default=list(RESULTS))
    p.add_argument("--output", default="bench_results/heads-eval-sharegpt-e4-full/learning_curve.png")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agreement = agreement_by_design(args.results)
    curve = sorted((TOKENS[d], 100 * a) for d, a in agreement.items() if d in TOKENS)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([t for t, _ in curve], [a for _, a in curve], "o-", label="ShareGPT, self-distilled")
    if MT_BENCH_HEAD[0] in agreement:
        ax.plot([MT_BENCH_HEAD[1]], [100 * agreement[MT_BENCH_HEAD[0]]], "s", label="MT-bench answers")
    ax.set_xscale("log")
    ax.set_xlabel("assistant tokens trained on")
    ax.set_ylabel("eval-split top-1 agreement, E=4 (%)")
    ax.set_title("SmolLM2-135M MLP exit head at layer 4")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    for tokens, value in curve:
        print(f"{tokens:>9,} tokens: {value:.1f} %")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
