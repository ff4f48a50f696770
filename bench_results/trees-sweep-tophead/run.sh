#!/usr/bin/env bash
# tree shapes against the calibrated chain, shipped top head at E=2, eval split --limit 4, one bench per shape
set -uo pipefail
cd "$(git rev-parse --show-toplevel)"
A=selfspec/assets/smollm2-135m
for shape in "4 6 3 0.05" "4 8 3 0.05" "2 6 3 0.05" "4 8 4 0.02"; do
  read tk sz k thr <<<"$shape"
  d=${OUT:-/tmp/tree-sweep}/t${tk}-s${sz}-k${k}-thr${thr}
  mkdir -p $d; cp $A/heads.safetensors $d/
  python - "$A/selfspec_config.json" "$d/selfspec_config.json" $tk $sz $k $thr <<'PY'
import json, sys
src, dst, tk, sz, k, thr = sys.argv[1:]
c = json.load(open(src))
c["metadata"]["calibration"]["per_drafter"]["early_exit-tree"].update(
    draft_tree_top_k=int(tk), draft_tree_size=int(sz), max_draft_tokens=int(k), draft_confidence_threshold=float(thr))
json.dump(c, open(dst, "w"), indent=2)
PY
  OMP_NUM_THREADS=1 selfspec bench --limit 4 --threads 1 --heads $d --methods hf-greedy selfspec selfspec-tree --output $d/bench > $d.log 2>&1
  grep -A6 "## overall" $d/bench/results.md
done
echo done
