"""`SelfSpecConfig`: the knobs of self-speculative decoding, saved as JSON next to the heads."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

CONFIG_NAME = "selfspec_config.json"
# where a calibration's record goes in a config's metadata, per decoding mode (sampled: True)
CALIBRATION_KEY = {False: "calibration", True: "calibration_sampled"}


@dataclass
class SelfSpecConfig:
    # --- shared by every drafter ---
    # Which drafter proposes tokens: early_exit, ngram, hybrid (both), model (a separate draft model), oracle, none
    # (drafters/registry.py lists them, with the settings each reads and the knobs a calibration searches for it).
    drafter: str = "early_exit"
    # Drafting runs decoder layers [0, exit_layer) plus an exit head; 1 <= exit_layer <= L-1.
    exit_layer: int = 8
    # Most tokens proposed per verification step (K); the verifier adds one of its own.
    max_draft_tokens: int = 6
    # Draft trees (EAGLE-2 style): children expanded per node; 1 drafts a chain. max_draft_tokens is the depth.
    draft_tree_top_k: int = 1
    # Most drafted tokens per verify pass of a tree (nodes of all branches together); needs >= max_draft_tokens.
    draft_tree_size: int = 16
    # A chain drafted by a copy head may run past max_draft_tokens, up to this many drafts, while every draft past
    # K is the head's copy candidate for a match of 2 or more tokens (0: never past K). Copying text runs long and
    # is right far more often than free text, so one K cannot suit both (see draft_length.copy_budget).
    copy_draft_tokens: int = 0
    # Run the passes after the prompt through torch.compile over a few static shapes (compiled.py): the first
    # passes of each shape compile (minutes on a CPU), every later one is faster; CUDA graphs on a GPU.
    compile: bool = False

    # --- each drafter's own settings: kept flat in the JSON, read and checked through the drafter's records ---
    # early_exit and hybrid (drafters.ConfidenceRule): stop drafting once the head's top probability falls below
    # this (0 disables the early stop); a tree stops growing once no child's cumulative draft probability reaches
    # it. With cumulative, a chain judges its next draft by the product of the head's top probabilities along the
    # chain so far (its path probability, as a tree scores nodes): long where the head is sure draft after draft
    # (a copy), short after two unsure ones.
    draft_confidence_threshold: float = 0.0
    draft_confidence_cumulative: bool = False
    # ngram and hybrid (drafters.NgramSettings): longest and shortest suffix n-gram the lookup matches.
    ngram_max: int = 3
    ngram_min: int = 1
    # hybrid (drafters.HybridPolicy): who drafts a row's step, by name (drafters/hybrid.py: lookup-first,
    # lookup-then-head, lookup-when-unsure, lookup-when-copying), and the matched suffix length that makes a lookup
    # strong.
    hybrid_policy: str = "lookup-then-head"
    hybrid_min_match: int = 2

    # --- per decoding mode ---
    # The fields above serve greedy decoding; these replace them when generate samples (do_sample=True), as
    # `selfspec calibrate --sample` writes them: sampling accepts fewer drafts, so what pays differs ({}: the same).
    sampling: dict = field(default_factory=dict)
    # Free-form notes a calibrator or trainer leaves behind (search results, versions); not used by the engine.
    metadata: dict = field(default_factory=dict)

    def validate(self, num_layers: int | None = None, own_drafter: str | None = None) -> "SelfSpecConfig":
        """Raise ValueError naming the bad field and the accepted range."""
        if not isinstance(self.max_draft_tokens, int) or self.max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be an integer >= 1, got {self.max_draft_tokens!r}.")
        if not isinstance(self.copy_draft_tokens, int) or self.copy_draft_tokens < 0:
            raise ValueError(f"copy_draft_tokens must be an integer >= 0 (0: a chain never runs past "
                             f"max_draft_tokens), got {self.copy_draft_tokens!r}.")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be true or false, got {self.compile!r}.")
        from .drafters import DRAFTERS  # late: the drafters import the engine, which imports this module

        known = tuple(DRAFTERS)
        if self.drafter not in known and self.drafter != own_drafter:  # own_drafter: a Drafter object's name
            raise ValueError(f"drafter must be one of {known}, got {self.drafter!r} (register your own with "
                             f"selfspec.drafters.register_drafter(name, factory)).")
        entry = DRAFTERS.get(self.drafter) if self.drafter != own_drafter else None
        if entry is not None:
            entry.records(self)  # the drafter's own settings, each record checking its fields
        if not isinstance(self.draft_tree_top_k, int) or self.draft_tree_top_k < 1:
            raise ValueError(f"draft_tree_top_k must be an integer >= 1 (1 drafts a chain), got "
                             f"{self.draft_tree_top_k!r}.")
        if self.draft_tree_top_k > 1 and (not isinstance(self.draft_tree_size, int)
                                          or self.draft_tree_size < self.max_draft_tokens):
            raise ValueError(f"draft_tree_size must be an integer >= max_draft_tokens={self.max_draft_tokens} (a "
                             f"tree as deep as a chain needs that many nodes), got {self.draft_tree_size!r}.")
        if not isinstance(self.sampling, dict):
            raise ValueError(f"sampling must be a mapping of config fields, got {self.sampling!r}.")
        bad = sorted(set(self.sampling) - set(self.__dataclass_fields__) | set(self.sampling) & {"sampling",
                                                                                                   "metadata"})
        if bad:
            raise ValueError(f"sampling holds {bad}, which are not settings; it takes the fields above it "
                             f"(drafter, exit_layer, max_draft_tokens, ...) for sampled generation.")
        if self.sampling:
            self.for_mode(True).validate(num_layers)
        # drafters that never run the early layers on their own (ngram, model, oracle, none) only use exit_layer
        # as the split of the verify pass, which any layer serves: the engine clamps it for them
        uses_exit = entry is not None and entry.uses_early_layers
        if num_layers is not None and uses_exit and not 1 <= self.exit_layer <= num_layers - 1:
            raise ValueError(
                f"exit_layer={self.exit_layer} is out of range for a model with {num_layers} decoder layers: "
                f"choose 1 <= exit_layer <= {num_layers - 1} (layers [0, exit_layer) draft, the rest verify)."
            )
        return self

    def drafter_settings(self) -> tuple:
        """The settings records of the configured drafter (drafters/registry.py), read from this config."""
        from .drafters import drafter_entry

        return drafter_entry(self.drafter).records(self)

    def for_mode(self, do_sample: bool) -> "SelfSpecConfig":
        """The settings a generate call runs with: the `sampling` ones over the rest when it samples."""
        if not do_sample or not self.sampling:
            return self
        return self.replace(**self.sampling, sampling={})

    def calibration(self, sampled: bool) -> dict:
        """The record of the calibration of one decoding mode (metadata), else the greedy one's; {} without any."""
        return self.metadata.get(CALIBRATION_KEY[sampled]) or self.metadata.get(CALIBRATION_KEY[False]) or {}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "SelfSpecConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known - {"base_model", "base_model_path", "heads", "selfspec_version"}
        flags = sorted(unknown & {"hybrid_extend", "hybrid_fallback", "hybrid_rematch"})
        if flags:
            raise ValueError(f"SelfSpecConfig fields {flags} are one named policy now: set hybrid_policy to "
                             f"lookup-first, lookup-then-head, lookup-when-unsure or lookup-when-copying (each adds "
                             f"one rule to the one before; drafters/hybrid.py) and drop them.")
        if unknown:
            raise ValueError(f"Unknown SelfSpecConfig fields {sorted(unknown)}. Fix: remove or rename them; the known "
                             f"fields are {sorted(known)}.")
        problem = _type_problem(data)
        if problem:
            raise ValueError(problem)
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, directory: str, extra: dict | None = None) -> str:
        """Write `selfspec_config.json` into `directory`; `extra` adds top-level keys (model identity, heads)."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, CONFIG_NAME)
        with open(path, "w") as f:
            json.dump({**self.to_dict(), **(extra or {})}, f, indent=2, sort_keys=True)
        return path

    @classmethod
    def load(cls, path: str) -> "SelfSpecConfig":
        """Load from a directory holding `selfspec_config.json` or from the JSON file itself; a field the file
        gets wrong is refused naming the file."""
        data = read_config_json(path)
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{config_file(path)}: {err}") from err

    def replace(self, **overrides) -> "SelfSpecConfig":
        return dataclasses.replace(self, **overrides)


# The JSON values each field's annotation takes, and their name in a message. A bool is no number here: a JSON true
# where an integer belongs is a mistake, though Python counts it as 1.
_JSON_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "dict": (dict,)}
_TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "dict": "an object"}
# What save_pretrained writes beside the fields, which loading the heads reads.
_SAVED_TYPES = {"base_model": ((dict,), "an object"), "base_model_path": ((str, type(None)), "a string or null"),
                "selfspec_version": ((str,), "a string"), "heads": ((list,), "a list of head specs")}
CONFIG_FIX = ("Fix: copy it again from where it was written, or write it again with "
              "model.selfspec.save_pretrained(DIR).")


def _type_problem(data: dict) -> str | None:
    """The first value of a config (its fields, its sampling fields, what save_pretrained adds) whose JSON type is
    not the one it takes, as a message with the fix; None if there is none. A value of the right type but out of
    range is `validate`'s to refuse."""
    sampling = data["sampling"] if isinstance(data.get("sampling"), dict) else {}
    for prefix, values in (("", data), ("sampling.", sampling)):
        for f in dataclasses.fields(SelfSpecConfig):
            value = values.get(f.name)
            if f.name in values and (not isinstance(value, _JSON_TYPES[f.type])
                                     or isinstance(value, bool) and f.type != "bool"):
                return (f"{prefix}{f.name} is {value!r}, which is not {_TYPE_NAMES[f.type]}. "
                        f"Fix: set {prefix}{f.name} to {_TYPE_NAMES[f.type]}.")
    for key, (types, name) in _SAVED_TYPES.items():
        if key in data and not isinstance(data[key], types):
            return f"{key} is {data[key]!r}, which is not {name}. {CONFIG_FIX}"
    bad = [h for h in data.get("heads") or [] if not isinstance(h, dict) or type(h.get("exit_layer")) is not int]
    if bad:
        return f"heads holds {bad[0]!r}, which is not a head spec (an object with an integer exit_layer). {CONFIG_FIX}"
    return None


def config_file(path: str) -> str:
    """The config file a path means: `selfspec_config.json` in a directory, else the path itself."""
    return os.path.join(path, CONFIG_NAME) if os.path.isdir(path) else path


def read_config_json(path: str) -> dict:
    """The JSON object of a config file (`config_file(path)`); a file that is missing, is not JSON or holds no
    object is refused naming it."""
    file = config_file(path)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"No selfspec config at {file!r} (expected a directory with {CONFIG_NAME}).")
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}:{err.lineno}: not JSON ({err.msg} at column {err.colno}). {CONFIG_FIX}") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"{file} is not text ({err.reason} at byte {err.start}). {CONFIG_FIX}") from err
    if not isinstance(data, dict):
        kind = {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(data), "number")
        raise ValueError(f"{file} holds a JSON {kind}, not an object of selfspec settings. {CONFIG_FIX}")
    return data
