#!/usr/bin/env bash
# Session 25: tokens a step of the shipped chain (E=1, K=4, threshold 0.1 on the path) with and without runs past
# K while it copies, against longer K, from the cost model's replay (float32 answers on the AVX2 Zen 3; counts, no
# timing). Eval split and MT-bench (the calibration's prompts, first turns), 4 prompts a category, 128 tokens.
set -euo pipefail
cd "$(dirname "$0")/../../.."
SETTINGS=('{"max_draft_tokens": 4}' '{"max_draft_tokens": 4, "copy_draft_tokens": 8}'
          '{"max_draft_tokens": 4, "copy_draft_tokens": 16}' '{"max_draft_tokens": 8}' '{"max_draft_tokens": 16}')
for split in eval train; do
  OMP_NUM_THREADS=1 python scripts/replay_chains.py --threads 1 --limit 4 --new-tokens 128 --split "$split" \
    "${SETTINGS[@]}" 2>/dev/null > "bench_results/zen3/replay25/$split.md"
done
