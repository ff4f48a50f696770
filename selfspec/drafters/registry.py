"""Every drafter a config can name, in one table: how an engine builds it, its class (what it declares: early layers,
trees, copy runs), its settings records (the config fields it reads and their checks) and the knobs a calibration
searches for it. `SelfSpecConfig.validate`, `build_drafter`, the calibrator's space and the CLIs all read this table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .base import ConfidenceRule, Drafter
from .early_exit import EarlyExitDrafter
from .hybrid import HybridChainDrafter, HybridPolicy
from .hybrid import from_engine as _hybrid_from_engine
from .model import DraftModelDrafter
from .model import from_engine as _model_from_engine
from .ngram import NgramDrafter, NgramSettings
from .oracle import OracleDrafter
from .oracle import from_engine as _oracle_from_engine

# the knobs every drafter that runs the exit head searches: where it exits, when it stops, its trees and copy runs
_HEAD_KNOBS = frozenset({"max_draft_tokens", "exit_layer", "draft_confidence_threshold", "draft_confidence_cumulative",
                         "draft_tree_top_k", "draft_tree_size", "copy_draft_tokens"})


@dataclass(frozen=True)
class DrafterEntry:
    """One drafter as selfspec knows it.

    build     engine -> Drafter, from the engine's config (and its heads or draft model)
    cls       the drafter's class: what it declares (uses_early_layers, drafts_trees, runs_copies) is read from it
    settings  its settings records: each is built from the config by `of(config)`, checks its fields as it is made,
              and names them in FIELDS
    searched  the config fields a calibration varies for it; `searchable` says whether a study may choose it at all
    from_config  whether a saved config rebuilds it (the oracle needs a reference only its caller has)"""

    name: str
    build: Callable
    cls: type = Drafter
    settings: tuple = ()
    searched: frozenset = frozenset()
    searchable: bool = False
    from_config: bool = True

    @property
    def uses_early_layers(self) -> bool:
        return self.cls.uses_early_layers

    def records(self, config) -> tuple:
        """The drafter's settings records read from `config`; raises ValueError naming a bad field."""
        return tuple(record.of(config) for record in self.settings)

    def fields(self) -> tuple:
        """The config fields the drafter's own records hold."""
        return tuple(name for record in self.settings for name in record.FIELDS)


DRAFTERS: dict[str, DrafterEntry] = {entry.name: entry for entry in (
    DrafterEntry("early_exit", EarlyExitDrafter.from_engine, EarlyExitDrafter, (ConfidenceRule,), _HEAD_KNOBS,
                 searchable=True),
    DrafterEntry("ngram", lambda engine: NgramDrafter.of(engine.config), NgramDrafter, (NgramSettings,),
                 frozenset({"max_draft_tokens", "ngram_max"}), searchable=True),
    DrafterEntry("hybrid", _hybrid_from_engine, HybridChainDrafter, (ConfidenceRule, NgramSettings, HybridPolicy),
                 _HEAD_KNOBS | {"ngram_max", "hybrid_min_match", "hybrid_policy"}, searchable=True),
    DrafterEntry("model", _model_from_engine, DraftModelDrafter),
    DrafterEntry("oracle", _oracle_from_engine, OracleDrafter, from_config=False),
    DrafterEntry("none", lambda engine: Drafter(), Drafter, searchable=True),
)}


def register_drafter(name: str, factory: Callable, cls: type = Drafter, settings: tuple = ()) -> None:
    """Make `name` a drafter a config can name: `factory(engine)` builds it. `cls` says what it declares (a drafter
    that runs the early layers must say so for exit_layer to be checked), `settings` its records, if any."""
    DRAFTERS[name] = DrafterEntry(name, factory, cls, tuple(settings))


def drafter_entry(name: str) -> DrafterEntry:
    if name not in DRAFTERS:
        raise ValueError(f"Unknown drafter {name!r}; available: {sorted(DRAFTERS)} (register your own with "
                         f"selfspec.drafters.register_drafter(name, factory)).")
    return DRAFTERS[name]


def build_drafter(engine) -> Drafter:
    return drafter_entry(engine.config.drafter).build(engine)


def searching(knob: str) -> tuple:
    """The searchable drafters whose calibration varies `knob` (a config field), in table order."""
    return tuple(name for name, entry in DRAFTERS.items() if entry.searchable and knob in entry.searched)
