"""Kept so that `python -m selfspec.bench` and `from selfspec import bench` go on working: the benchmark lives in
selfspec/tools/bench.py. Imported, this name is that module itself (not a copy), so its attributes are one."""
import sys

from selfspec.tools import bench as _tool

if __name__ == "__main__":
    sys.exit(_tool.main())
sys.modules[__name__] = _tool
