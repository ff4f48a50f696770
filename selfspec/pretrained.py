"""Load a model by name and wrap it: `selfspec.from_pretrained(name)` -> the wrapped model (like every
`from_pretrained`), `selfspec.load(name)` -> (wrapped model, tokenizer)."""
from __future__ import annotations

import dis
import os
import sys
from importlib import resources
from pathlib import Path

from .config import CONFIG_NAME, read_config_json
from .models import DEFAULT_MODEL, resolve_model
from .wrap import wrap


def shipped_dir(name: str) -> Path | None:
    """Heads and calibrated config shipped inside the package for an embedded model, if any."""
    path = Path(str(resources.files("selfspec") / "assets" / name))
    return path if (path / CONFIG_NAME).is_file() else None


def load(name_or_dir: str = DEFAULT_MODEL, heads: str | None = None, dtype="auto", device=None, **overrides):
    """(wrapped model, tokenizer).

    name_or_dir: "smollm2-135m" (the embedded default, with the heads and config shipped for it), a directory
    written by `model.selfspec.save_pretrained` whose config records `base_model_path`, or any local HF model
    directory / hub id (wrapped with the default config). `heads` overrides where heads and config come from;
    keyword overrides replace config fields (exit_layer=8, drafter="hybrid", ...). `compile=True` (an override)
    runs every pass after the prompt through the compiled step (compiled.py).
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


def from_pretrained(name_or_dir: str = DEFAULT_MODEL, heads: str | None = None, dtype="auto", device=None,
                    **overrides):
    """The wrapped model (arguments as for `load`); `selfspec.load` returns its tokenizer too."""
    if _result_is_unpacked(sys._getframe(1)):
        raise TypeError("selfspec.from_pretrained returns the model only, like every from_pretrained; for the model "
                        "and its tokenizer call `model, tokenizer = selfspec.load(name)`.")
    return load(name_or_dir, heads=heads, dtype=dtype, device=device, **overrides)[0]


def _result_is_unpacked(frame) -> bool:
    """Whether the caller unpacks the value of the call it is making (`a, b = f(...)`): its next instruction is
    UNPACK_SEQUENCE. A model is no sequence, so without this the unpacking would fail only after the model loaded,
    with Python's "cannot unpack non-iterable" and no word of `load`."""
    after = (i for i in dis.get_instructions(frame.f_code) if i.offset > frame.f_lasti)
    return next((i.opname for i in after), None) == "UNPACK_SEQUENCE"
