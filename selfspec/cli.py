"""`selfspec` command line: generate | bench | calibrate | train-heads. Each subcommand's module owns its flags
through a `main(argv)` of its own; this file only dispatches."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": ("selfspec.generate_cli", "stream an answer from a (wrapped) model and print speed stats"),
    "bench": ("selfspec.bench", "Spec-Bench-style benchmark against Hugging Face's own methods"),
    "calibrate": ("selfspec.calibrate", "Optuna search for the fastest exit layer / draft length on this device"),
    "train-heads": ("train.train_heads", "train early-exit heads by self-distillation"),
}

USAGE = "usage: selfspec {" + ",".join(COMMANDS) + "} [--help] ...\n\n" + "\n".join(
    f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()
) + "\n\nexample: selfspec generate \"Explain speculative decoding in two sentences.\"\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(USAGE, end="", file=sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
