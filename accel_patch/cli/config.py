"""`accel-patch config [--yes | --show | --remove] [--config_file PATH]`: the entry beside
accelerate's config that loads accel-patch in every Python start of this environment (what it
writes and why: integrations/config_entry.py).
"""
from __future__ import annotations

import json
import sys

from ..integrations import config_entry


def add_parser(commands):
    parser = commands.add_parser("config", help="load accel-patch in every Python start of this environment "
                                                "(asks, like accelerate config)")
    parser.add_argument("--yes", action="store_true", help="the defaults without questions: on, all kernels, callback")
    parser.add_argument("--show", action="store_true", help="print the entry and change nothing")
    parser.add_argument("--remove", action="store_true", help="delete the settings and the start-up hook")
    parser.add_argument("--config_file", "--config-file", dest="config_file", metavar="PATH",
                        help="accelerate's config file; accel-patch's is written beside it (default: "
                             "$HF_HOME/accelerate/, as accelerate)")
    return parser


def run(args) -> int:
    if args.show + args.remove + args.yes > 1:
        args.parser.error("choose one of --yes, --show, --remove")
    if args.show:
        entry = config_entry.describe(args.config_file)
        print(json.dumps(entry, indent=1))
        return 0
    if args.remove:
        removed, others = config_entry.remove(args.config_file)
        print(f"environment {sys.prefix}")
        print("\n".join(f"removed {p}" for p in removed) or "nothing to remove: accel-patch was not configured here")
        if others:
            print("the start-up hooks of other environments written for these settings are still installed; "
                  "they load nothing without the settings (remove each with that environment's "
                  "`accel-patch config --remove`):")
            print("\n".join(f"  {h}" for h in others))
        return 0
    if args.yes:
        settings = dict(config_entry.DEFAULTS)
    else:
        try:
            settings = config_entry.ask()
        except (EOFError, KeyboardInterrupt):
            print("\naccel-patch config: no answer, nothing written (accel-patch config --yes takes the defaults)",
                  file=sys.stderr)
            return 2
    path, hook = config_entry.write(settings, args.config_file)
    print(f"accel-patch config written:\n  settings  {path}  ("
          + ", ".join(f"{k}: {v}" for k, v in settings.items()) + ")")
    print(f"  start-up  {hook}  (loads accel-patch at every Python start of this environment, {sys.prefix}: "
          f"python, torchrun, accelerate launch; nothing when the settings say enabled: false)")
    others = [h for h in config_entry.environments(args.config_file) if h != str(hook)]
    if others:
        print("  the settings are shared with the other environments whose hooks read them:\n"
              + "\n".join(f"    {h}" for h in others))
    print(f"accelerate's own config in {path.parent} is not touched. Undo: accel-patch config --remove")
    return 0
