"""Runnable script: `python -m train.train_heads ...` or `python train/train_heads.py ...`. The code is
selfspec.training.train_heads, installed with the package (the wheel installs no top-level `train`);
imported, this name is that module itself, not a copy."""
import sys

from selfspec.training import train_heads as _module

if __name__ == "__main__":
    sys.exit(_module.main())
sys.modules[__name__] = _module
