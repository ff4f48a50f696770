"""How well the calibrator's cost model predicts a stored study: its predictions replayed against the measured trials.

    OMP_NUM_THREADS=1 python scripts/replay_study.py --heads configs/calibrated/smollm2-135m-e1-v2048 \
        --study smollm2-135m-copy-e1e2-v2048-cpu-bfloat16 --threads 1

Builds the predictor as `selfspec calibrate` does (plain answers to the calibration prompts, teacher-forced head
agreement, micro-timings, loop overheads; weights packed where the study's identity says its trials were) with the
current code, then predicts every measured trial of the study
and prints, per trial, predicted against measured tokens per step and tokens/s, and the Spearman rank correlation
over all trials and over trees. The tokens per step compare the acceptance replay alone; tokens/s also the timings,
which are measured again and vary from run to run.
"""
from __future__ import annotations

import argparse

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--heads", required=True, help="the heads the study calibrated (a save_pretrained directory)")
    p.add_argument("--study", required=True, help="the study's name")
    p.add_argument("--storage", default="sqlite:///configs/calibrated/smollm2-135m/study.db")
    p.add_argument("--max-prompts", type=int, default=8, help="what the study measured with")
    p.add_argument("--max-new-tokens", type=int, default=96, help="what the study measured with")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


@torch.no_grad()
def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import optuna

    import selfspec
    from selfspec.drafters import DRAFTER_FACTORIES
    from selfspec.models import resolve_model
    from selfspec.tools.calibrate import default_space_path, load_search_spec, resolve_space
    from selfspec.tools.calibrate.predictor import build_predictor
    from selfspec.tools.calibrate.space import describe
    from selfspec.tools.calibrate.trials import encode_prompts, load_calibration_texts, time_generation
    from selfspec.tools.measure import spearman

    model, tok = resolve_model(args.model, dtype="auto")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=args.study, storage=args.storage)
    if study.user_attrs.get("identity", {}).get("packed"):  # its trials ran packed: so must the timings
        selfspec.pack_weights(model)
    selfspec.wrap(model, args.heads)
    spec = load_search_spec(default_space_path(args.model))
    spec.measure.max_prompts, spec.measure.max_new_tokens = args.max_prompts, args.max_new_tokens
    prompts = encode_prompts(tok, load_calibration_texts(None, args.max_prompts), next(model.parameters()).device)
    space = resolve_space(spec, model.selfspec.adapter.num_layers, list(model.selfspec.heads), DRAFTER_FACTORIES)
    plain = time_generation(model, prompts, args.max_new_tokens, plain=True)
    predictor = build_predictor(model, model.selfspec.config, prompts, plain.outputs, space, spec.measure, print)
    rows = []
    for t in study.trials:
        prediction = predictor.predict(t.params) if t.user_attrs.get("measured") else None
        if prediction is not None:
            rows.append((t.params, prediction, t.user_attrs["mean_accepted_tokens"], t.value))
    print("| trial setting | tokens/step predicted | measured | tok/s predicted | measured |")
    print("|---|---|---|---|---|")
    for params, q, mat, tps in rows:
        print(f"| `{describe(params)}` | {q.mean_accepted_tokens:.2f} | {mat:.2f} | {q.tokens_per_s:.1f} | {tps:.1f} |")
    trees = [r for r in rows if r[0].get("draft_tree_top_k", 1) > 1]
    for name, part in (("all", rows), ("trees", trees)):
        if part:
            rho = spearman([r[1].tokens_per_s for r in part], [r[3] for r in part])
            ratio = sum(r[1].mean_accepted_tokens / r[2] for r in part) / len(part)
            rho = "undefined" if rho is None else f"{rho:.2f}"
            print(f"{name}: {len(part)} trials, Spearman of tok/s {rho}, mean predicted/measured tokens a step "
                  f"{ratio:.3f}")


if __name__ == "__main__":
    main()
