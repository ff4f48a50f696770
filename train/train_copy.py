"""Runnable script: `python -m train.train_copy ...` or `python train/train_copy.py ...`. The code is
selfspec.training.train_copy, installed with the package (the wheel installs no top-level `train`);
imported, this name is that module itself, not a copy."""
import sys

from selfspec.training import train_copy as _module

if __name__ == "__main__":
    sys.exit(_module.main())
sys.modules[__name__] = _module
