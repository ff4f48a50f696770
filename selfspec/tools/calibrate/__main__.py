"""python -m selfspec.tools.calibrate (or python -m selfspec.calibrate)."""
import sys

from .cli import main

sys.exit(main())
