NG='{"drafter": "ngram", "max_draft_tokens": 4, "ngram_max": 5, "draft_tree_top_k": 1}'
H='"drafter": "hybrid", "exit_layer": 1, "max_draft_tokens": 8, "draft_confidence_threshold": 0.6, "draft_confidence_cumulative": false, "ngram_max": 5, "hybrid_min_match": 4, "hybrid_extend": false, "hybrid_fallback": false, "hybrid_rematch": true, "draft_tree_top_k": 1'
M='"drafter": "hybrid", "exit_layer": 1, "max_draft_tokens": 4, "draft_confidence_threshold": 0.4, "draft_confidence_cumulative": false, "ngram_max": 3, "hybrid_min_match": 1, "hybrid_extend": true, "hybrid_fallback": true, "draft_tree_top_k": 1'
C='{"drafter": "early_exit", "exit_layer": 1, "max_draft_tokens": 5, "draft_confidence_threshold": 0.3, "draft_confidence_cumulative": false, "draft_tree_top_k": 1}'
cd "$(git rev-parse --show-toplevel)" && git apply bench_results/epyc-f25m17/adaptive-hybrid/adaptive_hybrid.patch && trap "git apply -R bench_results/epyc-f25m17/adaptive-hybrid/adaptive_hybrid.patch" EXIT
OMP_NUM_THREADS=1 python scripts/sweep_settings.py --threads 1 "$@" --heads configs/calibrated/smollm2-135m-rematch "$NG" "$C" "{$H}" "{$H, \"hybrid_adaptive\": true}" "{$M}" "{$M, \"hybrid_adaptive\": true}"
