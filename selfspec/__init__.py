"""selfspec: self-speculative decoding for Hugging Face causal LMs.

    model = selfspec.wrap(model, exit_layer=8, max_draft_tokens=6)   # in place
    out = model.generate(input_ids, max_new_tokens=128)               # same tokens, fewer full passes
    model.selfspec.last_stats

    model = selfspec.from_pretrained("smollm2-135m")    # the embedded model, wrapped with its shipped config
    model, tok = selfspec.load("smollm2-135m")           # the same, with its tokenizer

The names below are imported on first use, so that `import selfspec` (and `selfspec --help`) does not import
torch or transformers.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> submodule defining it
_LAZY = {
    "SelfSpecConfig": "config",
    "GenerationStats": "decoding",
    "SelfSpecEngine": "wrap",
    "wrap": "wrap",
    "unwrap": "wrap",
    "from_pretrained": "pretrained",
    "load": "pretrained",
}
__all__ = [*_LAZY, "__version__"]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    from .config import SelfSpecConfig
    from .decoding import GenerationStats
    from .pretrained import from_pretrained, load
    from .wrap import SelfSpecEngine, unwrap, wrap


class _Package(types.ModuleType):
    def __getattr__(self, name):  # only called for names not set yet
        if name not in _LAZY:
            # `selfspec.arch.adapter_for(...)` after a bare `import selfspec`: submodules load on first use too
            if not name.startswith("_") and importlib.util.find_spec(f"{self.__name__}.{name}") is not None:
                return importlib.import_module(f"{self.__name__}.{name}")
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{self.__name__}.{_LAZY[name]}"), name)
        self.__dict__[name] = value
        return value

    def __setattr__(self, name, value):
        # Importing the submodule `selfspec.wrap` makes the import system set the attribute `wrap` of this package
        # to that module; the public `selfspec.wrap` is the function, so a submodule never replaces a public name.
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_LAZY))


sys.modules[__name__].__class__ = _Package
