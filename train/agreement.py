"""Runnable script: `python -m train.agreement ...` or `python train/agreement.py ...`. The code is
selfspec.training.agreement, installed with the package (the wheel installs no top-level `train`);
imported, this name is that module itself, not a copy."""
import sys

from selfspec.training import agreement as _module

if __name__ == "__main__":
    sys.exit(_module.main())
sys.modules[__name__] = _module
