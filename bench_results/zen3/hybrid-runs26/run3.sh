# session 27: the same settings on the calibrator's prompts (MT-bench, one question per category, both turns), so that
# the counts show whether a calibration that offers the hybrid's runs has a reason to pick them
H='"drafter": "hybrid", "max_draft_tokens": 4, "hybrid_min_match": 2, "hybrid_extend": true, "hybrid_fallback": true, "hybrid_rematch": true, "ngram_max": 3'
S='"drafter": "hybrid", "max_draft_tokens": 8, "draft_confidence_threshold": 0.95, "draft_confidence_cumulative": true, "hybrid_min_match": 2, "hybrid_extend": false, "hybrid_fallback": false, "hybrid_rematch": true, "ngram_max": 3'
OMP_NUM_THREADS=1 python scripts/sweep_settings.py --threads 1 --mt-bench-turns 1 2 --new-tokens 64 --dtype float32 \
  "{$S}" "{$S, \"copy_draft_tokens\": 8}" "{$H}" "{$H, \"copy_draft_tokens\": 8}" "{$H, \"copy_draft_tokens\": 16}" \
  '{}' '{"drafter": "ngram", "max_draft_tokens": 8, "ngram_max": 3}'
