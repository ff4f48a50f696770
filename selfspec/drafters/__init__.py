"""Drafters behind one interface (base.py), and the table of those a config can name (registry.py):
`build_drafter(engine)` picks one by `engine.config.drafter`."""
from __future__ import annotations

from .base import ConfidenceRule, Draft, Drafter, DraftView, PromptStates, VerifyStep
from .early_exit import EarlyExitDrafter
from .hybrid import HybridChainDrafter, HybridPolicy, HybridTreeDrafter
from .model import DraftModelDrafter
from .ngram import NgramDrafter, NgramSettings
from .oracle import OracleDrafter
from .registry import DRAFTERS, DrafterEntry, build_drafter, drafter_entry, register_drafter

__all__ = ["ConfidenceRule", "Draft", "Drafter", "DraftView", "PromptStates", "VerifyStep", "EarlyExitDrafter",
           "DraftModelDrafter", "HybridChainDrafter", "HybridPolicy", "HybridTreeDrafter", "NgramDrafter",
           "NgramSettings", "OracleDrafter", "DRAFTERS", "DrafterEntry", "build_drafter", "drafter_entry",
           "register_drafter"]
