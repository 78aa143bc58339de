"""python -m accel_kernels.bench: see accel_kernels.bench.cli."""
import sys

from .cli import main

sys.exit(main())
