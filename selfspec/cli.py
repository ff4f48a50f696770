"""`selfspec` command line: generate | bench | prepare | calibrate | train-heads | train-copy | export-vllm.

Each subcommand's module owns its flags through a `main(argv)` of its own; this file dispatches and turns a user's
mistake (a bad value, a missing file or package, an unknown model) into one line on stderr with exit status 2 --
`--debug` shows the traceback instead.

Nothing heavy is imported here: `selfspec --help` and `selfspec generate --help` do not import torch."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": ("selfspec.generate_cli", "stream an answer from a (wrapped) model and print speed stats"),
    "bench": ("selfspec.tools.bench", "Spec-Bench-style benchmark against Hugging Face's own methods"),
    "prepare": ("selfspec.training.prepare", "train exit heads for a model and calibrate them, in one command"),
    "calibrate": ("selfspec.tools.calibrate", "Optuna search for the fastest exit layer / draft length on this device"),
    "train-heads": ("selfspec.training.train_heads", "train early-exit heads by self-distillation"),
    "train-copy": ("selfspec.training.train_copy", "make a trained MLP head a copy head (fit its trust in lookups)"),
    "export-vllm": ("selfspec.serving.export", "write a model's exit head as a vLLM draft model, print how to serve it"),
}

USAGE = "usage: selfspec [--debug] {" + ",".join(COMMANDS) + "} [--help] ...\n\n" + "\n".join(
    f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()
) + ("\n\n  --debug      on an error, show the full traceback instead of one line\n"
     "\nexample: selfspec generate \"Explain speculative decoding in two sentences.\"\n")

# A user's mistakes: bad values (ValueError), missing files or hub models (OSError), missing optional packages
# (ImportError). Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError, ImportError)

# optional package -> the extra that installs it
EXTRAS = {"optuna": "calibrate", "matplotlib": "bench", "gguf": "gguf", "bitsandbytes": "quant",
          "accelerate": "quant", "scipy": "test"}


def one_line(err: BaseException) -> str:
    """The error's message on one line, with the install command for a missing optional package."""
    text = " ".join(str(err).split()) or type(err).__name__
    name = getattr(err, "name", None) if isinstance(err, ImportError) else None
    root = name.split(".")[0] if name else None
    if root in EXTRAS and "pip install" not in text:
        text += f". Fix: pip install 'selfspec[{EXTRAS[root]}]'"
    return text


def _pop_debug(argv: list[str]) -> bool:
    """Remove every --debug before a `--` (it is this file's flag, whichever subcommand it follows)."""
    end = argv.index("--") if "--" in argv else len(argv)
    found = "--debug" in argv[:end]
    argv[:end] = [a for a in argv[:end] if a != "--debug"]
    return found


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _pop_debug(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name = argv[0]
    if name not in COMMANDS:
        print(f"selfspec: error: unknown command {name!r}; choose one of {', '.join(COMMANDS)} "
              "(see selfspec --help)", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[name][0])
        return module.main(argv[1:]) or 0
    except USER_ERRORS as err:
        if debug:
            raise
        print(f"selfspec {name}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"selfspec {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        # an interrupt that lands inside a library's own bookkeeping (Optuna's, while it records a trial) can
        # surface as another error raised while handling it: still an interrupt, and the run still resumes
        if debug or not interrupted(err):
            raise
        print(f"selfspec {name}: interrupted", file=sys.stderr)
        return 130


def interrupted(err: BaseException) -> bool:
    """Whether `err` was raised while a KeyboardInterrupt (Ctrl-C, or a SIGTERM taken as one) was handled."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())
