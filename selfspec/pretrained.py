"""`selfspec.from_pretrained(name_or_dir)` -> (wrapped model, tokenizer)."""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from .config import CONFIG_NAME, read_config_json
from .models import DEFAULT_MODEL, resolve_model
from .wrap import wrap


def shipped_dir(name: str) -> Path | None:
    """Heads and calibrated config shipped inside the package for an embedded model, if any."""
    path = Path(str(resources.files("selfspec") / "assets" / name))
    return path if (path / CONFIG_NAME).is_file() else None


def from_pretrained(name_or_dir: str = DEFAULT_MODEL, heads: str | None = None, dtype="auto", device=None,
                    **overrides):
    """Load a model and wrap it.

    name_or_dir: "smollm2-135m" (the embedded default, with the heads and config shipped for it), a directory
    written by `model.selfspec.save_pretrained` whose config records `base_model_path`, or any local HF model
    directory / hub id (wrapped with the default config). `heads` overrides where heads and config come from.
    """
    selfspec_dir = heads
    base = name_or_dir
    if os.path.isfile(os.path.join(str(name_or_dir), CONFIG_NAME)) and not os.path.isfile(
            os.path.join(str(name_or_dir), "config.json")):
        data = read_config_json(name_or_dir)
        base = data.get("base_model_path")
        if not base:
            raise ValueError(f"{name_or_dir!r} holds selfspec heads but no base_model_path: load the base model "
                             "yourself and call selfspec.wrap(model, that_dir).")
        selfspec_dir = selfspec_dir or str(name_or_dir)
    model, tokenizer = resolve_model(base, dtype=dtype, device=device)
    if selfspec_dir is None:
        shipped = shipped_dir(str(base))
        selfspec_dir = str(shipped) if shipped is not None else None
    return wrap(model, selfspec_dir, **overrides), tokenizer
