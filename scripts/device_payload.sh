#!/usr/bin/env bash
# Build what scripts/device_check.sh carries to a lent GPU machine (which has no network): .dev1 and .dev2, each
# under the device tool's 64 MiB a call. .dev1: the wheels the machine lacks (this machine's transformers and
# gguf) and the first 38.4 MB of the xz-compressed SmolLM2 .gguf; .dev2: the rest and the .gguf's sha256.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
rm -rf .dev1 .dev2 && mkdir -p .dev1 .dev2
version() { "$PYTHON" -c "from importlib.metadata import version; print(version('$1'))"; }
"$PYTHON" -m pip download -q --no-deps -d .dev1 "transformers==$(version transformers)" "gguf==$(version gguf)"
gguf="$("$PYTHON" -c "from selfspec.models import find_gguf; print(find_gguf())")"
sha256sum "$gguf" | cut -d' ' -f1 > .dev2/gguf.sha256
xz -T1 -6 -c "$gguf" > /tmp/smollm2.gguf.xz
head -c 38400000 /tmp/smollm2.gguf.xz > .dev1/part1
tail -c +38400001 /tmp/smollm2.gguf.xz > .dev2/part2
rm /tmp/smollm2.gguf.xz
du -sh .dev1 .dev2
