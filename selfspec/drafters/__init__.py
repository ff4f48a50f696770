"""Drafters behind one interface (base.py). `build_drafter(engine)` picks one by `engine.config.drafter`."""
from __future__ import annotations

from typing import Callable

from .base import ConfidenceRule, Draft, Drafter, DraftView, PromptStates, VerifyStep
from .early_exit import EarlyExitDrafter
from .oracle import OracleDrafter
from .oracle import from_engine as _oracle_from_engine
from .hybrid import HybridChainDrafter, HybridPolicy, HybridTreeDrafter
from .hybrid import from_engine as _hybrid_from_engine
from .model import DraftModelDrafter
from .model import from_engine as _model_from_engine
from .ngram import NgramDrafter

# name -> factory(engine) -> Drafter; other modules add theirs with `register_drafter`.
DRAFTER_FACTORIES: dict[str, Callable] = {
    "early_exit": lambda engine: EarlyExitDrafter(
        engine.head_for(engine.config.exit_layer), ConfidenceRule.of(engine.config)),
    "none": lambda engine: Drafter(),
    "oracle": _oracle_from_engine,  # needs engine.drafter_override; the factory says so
    "ngram": lambda engine: NgramDrafter(engine.config.ngram_max, engine.config.ngram_min),
    "model": _model_from_engine,
    "hybrid": _hybrid_from_engine,
}


def register_drafter(name: str, factory: Callable) -> None:
    DRAFTER_FACTORIES[name] = factory


def build_drafter(engine) -> Drafter:
    name = engine.config.drafter
    if name not in DRAFTER_FACTORIES:
        raise ValueError(f"Unknown drafter {name!r}; available: {sorted(DRAFTER_FACTORIES)}.")
    return DRAFTER_FACTORIES[name](engine)


__all__ = ["ConfidenceRule", "Draft", "Drafter", "DraftView", "PromptStates", "VerifyStep", "EarlyExitDrafter",
           "HybridChainDrafter", "HybridPolicy", "HybridTreeDrafter", "build_drafter", "register_drafter",
           "DRAFTER_FACTORIES"]
