"""`accel-patch`: what accel-patch sees and will do (`env`), the self-test (`check`), the
accelerate-config entry (`config`), and the demo fine-tune (`demo`).

`env` prints the versions, the topology with `topology().sources` (where each value came from),
the decision for accelerate's state and the device map, the config entry, and `status()`. `--json`
prints the same as one JSON object. A bad launcher variable is a one-line error and exit code 2,
never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from importlib import metadata

from . import __version__, status
from .topology_resolver import TopologyError

DESCRIPTION = ("What accel-patch sees and will do on this machine (env), its self-test (check), the entry that "
               "loads it in every Python start (config), and a demo fine-tune (demo).")
DISTRIBUTIONS = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "triton", "accel-patch")
FIELDS = ("world_size", "rank", "local_rank", "local_world_size", "num_nodes")


def versions() -> dict[str, str]:
    """Installed versions, read from package metadata (nothing is imported)."""
    found = {"python": platform.python_version()}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def env_report() -> dict:
    """Everything `accel-patch env` shows. Raises TopologyError for a bad launcher variable."""
    from . import config_entry
    from .accelerate_state import decide
    from .device_map import prepare_device_map
    from .topology_resolver import scrub_blank_env, topology

    environ = dict(os.environ)
    topo = topology(environ)  # before scrubbing: its sources name the variables set but blank
    scrub_blank_env(environ)  # blank means unset, as at decision time
    decision = decide(topo, environ=environ)
    device_map, distributed = prepare_device_map(topo)
    return {
        "versions": versions(),
        "topology": {
            "launcher": topo.launcher,
            **{name: getattr(topo, name) for name in FIELDS},
            "device_type": topo.device_type,
            "device_count": topo.device_count,
            "single_device": topo.single_device,
            "sources": dict(topo.sources),
        },
        "accelerate_state": {"action": decision.action, "reason": decision.reason},
        "device_map": device_map,
        "is_distributed": distributed,
        "config_entry": config_entry.describe(),
        # After decide(): it imports accelerate, so the accelerate patch shows as it will bind.
        "status": [
            {"name": s.name, "state": s.state, "reason": s.reason, "target": s.target, "verified": s.verified}
            for s in status()
        ],
    }


def _print_report(report: dict) -> None:
    print(f"accel-patch {__version__}\n\nversions")
    for name, version in report["versions"].items():
        print(f"  {name:<14} {version}")
    topo = report["topology"]
    sources = topo["sources"]
    print(f"\ntopology (launcher: {topo['launcher']}, from {sources['launcher']})")
    for name in FIELDS:
        print(f"  {name:<17} {topo[name]:<6} from {sources[name]}")
    print(f"  {'devices':<17} {topo['device_count']:<6} {topo['device_type']}, from {sources['device_count']}")
    print(f"  {'single_device':<17} {topo['single_device']}")
    state = report["accelerate_state"]
    print(f"\naccelerate state: {state['action']}\n  {state['reason']}")
    print(f"\ndevice map: {json.dumps(report['device_map'])}"
          f" ({'distributed' if report['is_distributed'] else 'one process'})")
    entry = report["config_entry"]
    settings = ", ".join(f"{k}: {v}" for k, v in (entry["settings"] or {}).items())
    print(f"\nconfig entry (accel-patch config): {'configured' if entry['configured'] else 'not configured'}")
    print(f"  settings   {entry['config_file']}" + (f" ({settings})" if settings else " (absent)"))
    print(f"  start-up   {entry['hook_file']} ({'installed' if entry['hook_installed'] else 'absent'})")
    print(f"  this process: {entry['this_process']}")
    print(f"\npatches\n  {'NAME':<17} {'STATE':<9} REASON")
    for s in report["status"]:
        print(f"  {s['name']:<17} {s['state']:<9} {s['reason']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="accel-patch", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"accel-patch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser("env", help="versions, topology, decisions and patch status")
    env.add_argument("--json", action="store_true", help="one JSON object, for machines")
    check = commands.add_parser("check", help="self-test: kernels, swapped models and this launch; exit 0 if all pass")
    check.add_argument("--json", action="store_true", help="one JSON object, for machines")
    check.add_argument("--parts", type=_parts, default=CHECK_PARTS,
                       help=f"comma list among {','.join(CHECK_PARTS)} (default: all)")
    config = commands.add_parser("config", help="load accel-patch in every Python start of this environment "
                                                "(asks, like accelerate config)")
    config.add_argument("--yes", action="store_true", help="the defaults without questions: on, all kernels, callback")
    config.add_argument("--show", action="store_true", help="print the entry and change nothing")
    config.add_argument("--remove", action="store_true", help="delete the settings and the start-up hook")
    config.add_argument("--config_file", "--config-file", dest="config_file", metavar="PATH",
                        help="accelerate's config file; accel-patch's is written beside it (default: "
                             "$HF_HOME/accelerate/, as accelerate)")
    # The demo parses its own options (its --help included).
    commands.add_parser("demo", help="fine-tune a small Llama with LoRA on this machine", add_help=False)
    args, rest = parser.parse_known_args(argv)

    if args.command == "demo":
        demo = importlib.import_module("accel_patch.demo")  # imports torch and transformers
        return int(demo.main(rest) or 0)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "check":
        return _check(args)
    if args.command == "config":
        return _config(args, parser)
    try:
        report = env_report()
    except TopologyError as exc:
        print(f"accel-patch: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        _print_report(report)
    return 0


CHECK_PARTS = ("kernels", "models", "launch")


def _parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in CHECK_PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"choose among {','.join(CHECK_PARTS)}, got {text!r}")
    return parts


def _check(args) -> int:
    import torch

    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        # No GPU: check the Triton kernels themselves, on the CPU, under Triton's interpreter.
        os.environ["TRITON_INTERPRET"] = "1"
        if not args.json:
            print("no GPU: the Triton kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1)\n")
    from . import check

    return check.main(as_json=args.json, parts=args.parts)


def _config(args, parser) -> int:
    from . import config_entry

    if args.show + args.remove + args.yes > 1:
        parser.error("choose one of --yes, --show, --remove")
    if args.show:
        entry = config_entry.describe(args.config_file)
        print(json.dumps(entry, indent=1))
        return 0
    if args.remove:
        removed = config_entry.remove(args.config_file)
        print("\n".join(f"removed {p}" for p in removed) or "nothing to remove: accel-patch was not configured here")
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
    print(f"  start-up  {hook}  (loads accel-patch at every Python start of this environment: python, "
          f"torchrun, accelerate launch; nothing when the settings say enabled: false)")
    print(f"accelerate's own config in {path.parent} is not touched. Undo: accel-patch config --remove")
    return 0


if __name__ == "__main__":
    sys.exit(main())
