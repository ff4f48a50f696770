"""Kept so that `python -m selfspec.calibrate` and `from selfspec.calibrate import ...` go on working: the
calibrator lives in selfspec/tools/calibrate/. Imported, this name is that package itself (not a copy)."""
import sys

from selfspec.tools import calibrate as _tool

if __name__ == "__main__":
    sys.exit(_tool.main())
sys.modules[__name__] = _tool
