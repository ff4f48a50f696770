"""Exit-head training code, installed with the package: `collect` (self-distillation data: the model's own
answers to Spec-Bench's train split, or ShareGPT conversations teacher-forced, `selfspec[train]`), `agreement`
(untrained exit agreement on that data), `train_heads` (self-distillation on the cached hidden states,
`selfspec train-heads`) and `eval_heads` (head designs compared on the eval split). The repository's `train/`
folder holds the runnable scripts (`python -m train.collect`, `python -m train.train_heads`, ...), which run
these modules."""
