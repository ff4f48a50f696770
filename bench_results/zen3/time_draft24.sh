#!/usr/bin/env bash
# Session 23's cheaper drafted token, before and after, side by side on session 24's machine (AMD EPYC Zen 3,
# AVX2 only, so the model runs in float32, its auto dtype here): scripts/time_draft.py over session 22's code
# (93b318f, a git worktree at /tmp/wt22) and over the checkout (session 23's drafting code, 090a5c5), both with
# session 22's heads and settings (configs/calibrated/smollm2-135m-folded: E=1 chains, K=8, threshold 0.35 on the
# path), alternated twice so that the shared machine's drift shows. Nothing else ran.
#   git worktree add /tmp/wt22 93b318f
#   bash bench_results/zen3/time_draft24.sh > bench_results/zen3/time_draft24.txt 2>/dev/null
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export OMP_NUM_THREADS=1
for round in 1 2; do
  echo "=== round $round: before (93b318f) ==="
  (cd /tmp/wt22 && PYTHONPATH=/tmp/wt22 python scripts/time_draft.py --threads 1 \
      --heads "$OLDPWD/configs/calibrated/smollm2-135m-folded")
  echo "=== round $round: after (the checkout: 090a5c5's drafting code) ==="
  python scripts/time_draft.py --threads 1 --heads configs/calibrated/smollm2-135m-folded
done
