"""The calibration report: every trial, the top measured ones, the final re-timing against plain `generate`, and the
cost model's predictions against measurement (Spearman's rank correlation); written as JSON and Markdown next to
the calibrated config."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING

import torch

from ...config import SelfSpecConfig
from ..measure import spearman
from .space import describe

if TYPE_CHECKING:
    from .study import Session

REPORT_NAME = "calibration_report"


def trial_rows(study) -> list[dict]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        rows.append({"trial": t.number, "state": t.state.name, "params": dict(t.params), "value": t.value,
                     "predicted_tokens_per_s": attrs.get("predicted_tokens_per_s"),
                     "acceptance_rate": attrs.get("acceptance_rate"),
                     "mean_accepted_tokens": attrs.get("mean_accepted_tokens"),
                     "draft_seconds": attrs.get("draft_seconds"), "verify_seconds": attrs.get("verify_seconds"),
                     "matches_plain": attrs.get("matches_plain"), "near_ties": attrs.get("near_ties"),
                     "differs": attrs.get("differs"), "measured": bool(attrs.get("measured")),
                     "pruned_by_cost_model": attrs.get("pruned_by_cost_model"),
                     "enqueued_by": attrs.get("enqueued_by")})
    return rows


def build_report(study, session: Session, confirmed: list[dict], plain_tps: float, best: SelfSpecConfig) -> dict:
    rows = trial_rows(study)
    measured = [r for r in rows if r["measured"] and r["state"] == "COMPLETE"]
    paired = [r for r in measured if r["predicted_tokens_per_s"]]
    top5 = sorted(measured, key=lambda r: r["value"], reverse=True)[:5]
    predictor = session.predictor
    return {
        "best": best.to_dict(), "best_tokens_per_s": confirmed[0]["confirmed_tokens_per_s"],
        "plain_tokens_per_s": plain_tps, "speedup": confirmed[0]["confirmed_tokens_per_s"] / plain_tps,
        # the config drafts nothing although the fastest setting drafts: no setting beat plain generate
        "drafts_nothing_instead": best.drafter == "none" and confirmed[0]["params"].get("drafter") != "none",
        "confirmed": confirmed, "top5": top5, "trials": rows,
        "counts": {"trials": len(rows), "measured": len(measured),
                   "pruned_by_cost_model": sum(1 for r in rows if r["pruned_by_cost_model"]),
                   "duplicates": sum(1 for r in rows if r["state"] == "COMPLETE" and not r["measured"])},
        "cost_model": None if predictor is None else {
            "spearman_predicted_vs_measured": spearman([r["predicted_tokens_per_s"] for r in paired],
                                                       [r["value"] for r in paired]),
            "predicted_best": [{"params": p, "tokens_per_s": pr.tokens_per_s,
                                "mean_accepted_tokens": pr.mean_accepted_tokens}
                               for p, pr in predictor.best(5)],
            "predicted_plain_engine_tokens_per_s": predictor.plain_tokens_per_s(),
            "acceptance_profile": predictor.profile_summary(session.space.max_draft_tokens[-1]),
            "timings": predictor.timings.to_dict()},
        "study": {"name": study.study_name, "user_attrs": study.user_attrs},
        "measure": dataclasses.asdict(session.spec.measure), "space": session.space.to_dict(),
        # sampled trials are not judged (their outputs differ from plain generate's by chance): None
        "all_outputs_match_plain": None if session.spec.measure.sample else all(r["matches_plain"] for r in measured),
        # half precision: trials whose outputs part from plain only at near-ties (tools.verdict); any differs is a bug
        "exactness": None if session.spec.measure.sample else {
            "identical_trials": sum(1 for r in measured if r["matches_plain"]),
            "near_tie_trials": sum(1 for r in measured if r["near_ties"] and not r["differs"]),
            "differing_trials": sum(1 for r in measured if r["differs"])},
    }


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report_markdown(report: dict) -> str:
    ident = report["study"]["user_attrs"].get("identity", {})
    env = report["study"]["user_attrs"].get("environment", {})
    lines = [
        f"# Calibration: {ident.get('model_name', '?')} on {ident.get('device', '?')} ({ident.get('dtype', '?')})",
        "",
        f"Best setting: `{describe(report['confirmed'][0]['params'])}` - "
        f"**{report['best_tokens_per_s']:.2f} tok/s** against plain `generate` at "
        f"{report['plain_tokens_per_s']:.2f} tok/s (**x{report['speedup']:.2f}**), both re-timed in the same run.",
        *([] if not report["drafts_nothing_instead"]
          else ["", "**No setting beat plain `generate` here**, so the config written drafts nothing (drafter "
                    "`none`): wrapped, the model decodes as plain `generate` does. Each drafter's best is kept in "
                    "`per_drafter` (what `selfspec bench` runs)."]),
        "",
        f"Study `{report['study']['name']}`: {report['counts']['trials']} trials, {report['counts']['measured']} "
        f"measured, {report['counts']['pruned_by_cost_model']} pruned by the cost model, "
        f"{report['counts']['duplicates']} duplicates. {_exactness_sentence(report)}",
        f"Measured on {report['measure']['max_new_tokens']} new tokens x prompts per trial ({_turns(report)}); torch "
        f"{env.get('torch', '?')}, transformers {env.get('transformers', '?')}, {env.get('torch_threads', '?')} "
        f"threads, {_where(env)}.",
        "", "## Top 5 measured trials", "",
        "| trial | setting | measured tok/s | predicted tok/s | acceptance | tokens/step | draft s | verify s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["top5"]:
        lines.append(f"| {r['trial']} | `{describe(r['params'])}` | {_fmt(r['value'])} | "
                     f"{_fmt(r['predicted_tokens_per_s'])} | {_fmt(r['acceptance_rate'])} | "
                     f"{_fmt(r['mean_accepted_tokens'])} | {_fmt(r['draft_seconds'])} | {_fmt(r['verify_seconds'])} |")
    lines += ["", "## Final comparison (interleaved re-timing)", "", "| setting | tok/s | vs plain |",
              "| --- | --- | --- |"]
    lines += [f"| `{describe(r['params'])}` | {r['confirmed_tokens_per_s']:.2f} | x{r['speedup']:.2f} |"
              for r in report["confirmed"]]
    lines.append(f"| plain `generate` | {report['plain_tokens_per_s']:.2f} | x1.00 |")
    lines += _cost_model_markdown(report)
    return "\n".join(lines) + "\n"


def _turns(report: dict) -> str:
    """Which turns of each question the trials timed (a report written before measure.turns timed first turns)."""
    turns = report["measure"].get("turns", [1])
    return {(1,): "first user turns", (2,): "second turns, after the model's own answer to the first"}.get(
        tuple(turns), "first and second user turns, each second after the model's own answer to the first")


def _exactness_sentence(report: dict) -> str:
    ex = report.get("exactness")
    if report.get("measure", {}).get("sample"):
        m = report["measure"]
        return (f"Sampled at temperature {m['temperature']}, top-p {m['top_p']} (seed {m['seed']}), so outputs were "
                f"not compared with plain generate's.")
    if ex is None:  # a report written before verdicts were kept
        return f"Greedy outputs of every measured trial equal plain generate: {report['all_outputs_match_plain']}."
    return (f"Greedy outputs against plain generate: {ex['identical_trials']} trials identical, "
            f"{ex['near_tie_trials']} part from it only at near-ties of the plain model (half-precision rounding), "
            f"{ex['differing_trials']} differ (a bug).")


def _where(env: dict) -> str:
    """The device a study ran on, from its environment (measure.environment; older studies: gpu / cpu_count)."""
    gpu = env.get("gpu") or (env.get("device") if env.get("device") not in (None, "cpu") else None)
    return gpu or f"{env.get('cpu') or env.get('machine', '?')} ({env.get('cores', env.get('cpu_count', '?'))} cores)"


def _cost_model_markdown(report: dict) -> list[str]:
    cm = report["cost_model"]
    if cm is None:
        return []
    lines = ["", "## Cost model", "",
             f"Spearman rank correlation of predicted vs measured tokens/s over measured trials: "
             f"{_fmt(cm['spearman_predicted_vs_measured'])}.", "",
             "| trial | setting | predicted tok/s | measured tok/s |", "| --- | --- | --- | --- |"]
    for r in report["trials"]:
        if r["measured"] and r["predicted_tokens_per_s"] is not None:
            lines.append(f"| {r['trial']} | `{describe(r['params'])}` | {r['predicted_tokens_per_s']:.2f} | "
                         f"{_fmt(r['value'])} |")
    lines += ["", "Teacher-forced agreement of the exit head with the full model (draft position 0, 1, 2 given the "
              "previous accepted):", "", "| exit layer | agreement | P(accept j \\| previous) j=0,1,2 |",
              "| --- | --- | --- |"]
    for layer, prof in cm["acceptance_profile"].items():
        lines.append(f"| {layer} | {prof['agreement']:.3f} | "
                     f"{', '.join(f'{p:.2f}' for p in prof['position_profile'][:3])} |")
    return lines


def save_result(model, best: SelfSpecConfig, report: dict, output: str, extra: dict, name: str = REPORT_NAME) -> None:
    """Config (and heads, through the engine's save_pretrained when it exists) + the report, into `output`."""
    os.makedirs(output, exist_ok=True)
    engine = model.selfspec
    engine.config = best
    if hasattr(engine, "save_pretrained"):
        with torch.no_grad():  # the base model's fingerprint reads its weights
            engine.save_pretrained(output)
    else:
        best.save(output, extra=extra)
    with open(os.path.join(output, name + ".json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(os.path.join(output, name + ".md"), "w") as f:
        f.write(report_markdown(report))
