"""Exit-head training code, installed with the package: `train_heads` (self-distillation on cached hidden states,
`selfspec train-heads`) and `eval_heads` (head designs compared on the eval split). The repository's `train/`
folder holds the runnable scripts (`python -m train.collect`, `python -m train.train_heads`, ...); the data
collection itself (`train/collect.py`, `train/agreement.py`) stays there for now."""
