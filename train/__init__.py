"""Training scripts: data collection (collect.py) and exit-head training (train_heads.py)."""
