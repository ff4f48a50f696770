# session 27: where the hybrid's runs pay, per eval-split category (--by-category): the head-led hybrid without and
# with runs to 8, n-grams, the shipped chain
H='"drafter": "hybrid", "max_draft_tokens": 4, "hybrid_min_match": 2, "hybrid_extend": true, "hybrid_fallback": true, "hybrid_rematch": true, "ngram_max": 3'
OMP_NUM_THREADS=1 python scripts/sweep_settings.py --threads 1 --limit 4 --new-tokens 128 --dtype float32 --by-category \
  "{$H}" "{$H, \"copy_draft_tokens\": 8}" '{"drafter": "ngram", "max_draft_tokens": 8, "ngram_max": 3}' '{}'
