# session 28 (Intel Xeon with AMX-BF16, 2 cores): bf16 counts and tok/s of the candidates on the eval split,
# settings taking turns prompt by prompt; a calibration ran on the other core at the same time.
# chain K=4 (shipped), the same with copy runs to 8, n-grams K=8, head-led hybrid with runs to 8 (the seed),
# the shipped hybrid (K=8, threshold 0.95 on the path, 2-token match, rematch)
OMP_NUM_THREADS=1 python scripts/sweep_settings.py --threads 1 --limit 4 --new-tokens 128 --dtype bfloat16 --by-category \
  '{}' '{"copy_draft_tokens": 8}' '{"drafter": "ngram", "max_draft_tokens": 8, "ngram_max": 3}' \
  '{"drafter": "hybrid", "max_draft_tokens": 4, "draft_confidence_threshold": 0.1, "hybrid_min_match": 2, "hybrid_extend": true, "hybrid_fallback": true, "hybrid_rematch": true, "ngram_max": 3, "copy_draft_tokens": 8}' \
  '{"drafter": "hybrid", "max_draft_tokens": 8, "draft_confidence_threshold": 0.95, "hybrid_min_match": 2, "hybrid_extend": false, "hybrid_fallback": false, "hybrid_rematch": true, "ngram_max": 3}'
