"""`python -m accel_patch.cli ...`: the `accel-patch` command."""
import sys

from . import main

sys.exit(main())
