"""`selfspec calibrate`: find the fastest self-speculative setting for a model, its heads, a prompt set and this
device, with an Optuna study whose trials are real timed generations.

    selfspec calibrate --model smollm2-135m [--heads DIR [DIR ...]] [--prompts FILE] [--trials N] [--timeout S]
                       [--storage URL] [--output DIR] [--space smollm2-135m | FILE.yaml]
    python -m selfspec.calibrate ...   # the same

Searched: exit layer, max_draft_tokens, draft_confidence_threshold (and a chain's rule for it), the drafter
(early_exit, and ngram / hybrid when registered) and ngram_max. The objective is generated tokens/s of greedy
`generate` over the calibration prompts, with warm-up and device synchronisation. A cost model (../cost_model.py)
measured once per exit layer predicts every early-exit setting first: the predicted best are enqueued as the first
trials and settings predicted far below the best measured so far are pruned unmeasured. The best setting is re-timed
against plain `generate` in the same run and written to --output with a Markdown + JSON report.

Modules: space.py (the YAML specification and the resolved space), trials.py (prompts and timed generation),
predictor.py (the cost model's predictions over the space), study.py (the Optuna study and `calibrate`),
report.py (JSON + Markdown report), cli.py (the command line); search_spaces/ holds the shipped YAML
specifications (package data).
"""
from __future__ import annotations

from .cli import main, parse_args
from .predictor import MODELLED_DRAFTERS, Predictor, build_predictor
from .report import REPORT_NAME, build_report, report_markdown, save_result, trial_rows
from .space import (EXIT_DRAFTERS, NGRAM_DRAFTERS, SEARCH_SPACES, SEARCHABLE_DRAFTERS, MeasureSpec, SearchSpace,
                    SearchSpec, SpaceSpec, StrategySpec, default_space_path, describe, load_search_spec, resolve_space,
                    shipped_spaces, suggest, trial_config)
from .study import (CalibrationResult, Session, best_per_drafter, calibrate, confirm, default_storage,
                    enqueue_predicted, open_study, study_identity, top_settings)
from .trials import (Measurement, encode_prompts, encode_turns, generate_once, load_calibration_prompts,
                     load_calibration_texts, pick_prompts, time_generation, time_setting)

__all__ = [
    "CalibrationResult", "EXIT_DRAFTERS", "MODELLED_DRAFTERS", "Measurement", "MeasureSpec", "NGRAM_DRAFTERS",
    "Predictor", "REPORT_NAME", "SEARCH_SPACES", "SEARCHABLE_DRAFTERS", "SearchSpace", "SearchSpec", "Session",
    "SpaceSpec", "StrategySpec", "best_per_drafter", "build_predictor", "build_report", "calibrate", "confirm",
    "default_space_path", "default_storage", "describe", "encode_prompts", "encode_turns", "enqueue_predicted",
    "generate_once", "load_calibration_prompts", "load_calibration_texts", "load_search_spec", "main", "open_study",
    "parse_args", "pick_prompts",
    "report_markdown", "resolve_space", "save_result", "shipped_spaces", "study_identity", "suggest",
    "time_generation", "time_setting", "top_settings", "trial_config", "trial_rows",
]
