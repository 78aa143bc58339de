"""The face: the `accel-patch` command, one module per subcommand.

    env.py      what accel-patch sees and will do: versions, topology and where each value came
                from, the decisions, the config entry, `status()`
    check.py    the self-test (kernels, swapped models, this launch)
    config.py   the accelerate-config entry (writes, shows, removes it)
    demo.py     the demo fine-tune (also `python -m accel_patch.demo`)
    report.py   the report `env` prints and `check` reads (so neither imports the other)

This room may import every other room (core, patches, integrations, swaps) and the package root;
nothing below imports it. Each subcommand module has `add_parser(commands)` and `run(args)`.
Output piped into a reader that stops early (`accel-patch env | head -1`) ends quietly.
"""
from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from . import check, config, demo, env

DESCRIPTION = ("What accel-patch sees and will do on this machine (env), its self-test (check), the entry that "
               "loads it in every Python start (config), and a demo fine-tune (demo).")
COMMANDS = (env, check, config, demo)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="accel-patch", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"accel-patch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands).set_defaults(run=command.run)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        args.rest = rest  # the demo parses its own options (its --help included)
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.parser = parser
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as CLI tools do; Python would otherwise
        # print a traceback, and another when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a program a closed pipe stopped
    return code
