"""`python -m accel_patch.demo` (also under torchrun and accelerate launch): the demo fine-tune.

The demo lives with the rest of the command line, in cli/demo.py (`accel-patch demo`); this
module keeps the `-m accel_patch.demo` entry users and launch scripts already call.
"""
import sys

from .cli.demo import main

if __name__ == "__main__":
    sys.exit(main())
