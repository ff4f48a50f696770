OMP_NUM_THREADS=1 python scripts/sweep_settings.py --threads 1 --limit 2 --new-tokens 96 --heads configs/calibrated/smollm2-135m-turns \
 '{"drafter": "ngram", "max_draft_tokens": 5, "ngram_max": 5, "draft_tree_top_k": 1}' \
 '{"drafter": "ngram", "max_draft_tokens": 3, "ngram_max": 2, "draft_tree_top_k": 1}' \
 '{"drafter": "hybrid", "exit_layer": 1, "max_draft_tokens": 4, "draft_confidence_threshold": 0.45, "draft_confidence_cumulative": false, "ngram_max": 4, "hybrid_min_match": 4, "hybrid_extend": true, "hybrid_fallback": true, "draft_tree_top_k": 1}' \
 '{"drafter": "hybrid", "exit_layer": 1, "max_draft_tokens": 4, "draft_confidence_threshold": 0.4, "draft_confidence_cumulative": false, "ngram_max": 3, "hybrid_min_match": 1, "hybrid_extend": true, "hybrid_fallback": true, "draft_tree_top_k": 1}' \
 '{"drafter": "hybrid", "exit_layer": 1, "max_draft_tokens": 5, "draft_confidence_threshold": 0.45, "draft_confidence_cumulative": false, "ngram_max": 5, "hybrid_min_match": 1, "hybrid_extend": false, "hybrid_fallback": false, "draft_tree_top_k": 1}'
