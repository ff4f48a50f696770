"""The repository's runnable training scripts (not installed with the wheel): collect.py (data collection) and
agreement.py (the untrained exit's baseline) live here; train_heads.py and eval_heads.py run the installed
selfspec.training modules."""
