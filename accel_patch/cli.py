"""`accel-patch`: what accel-patch sees and will do (`env`), and the demo fine-tune (`demo`).

`env` prints the versions, the topology with `topology().sources` (where each value came from),
the decision for accelerate's state and the device map, and `status()`. `--json` prints the same
as one JSON object. A bad launcher variable is a one-line error and exit code 2, never a traceback.
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

DESCRIPTION = "What accel-patch sees and will do on this machine (env), and a demo fine-tune (demo)."
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
    print(f"\npatches\n  {'NAME':<17} {'STATE':<9} REASON")
    for s in report["status"]:
        print(f"  {s['name']:<17} {s['state']:<9} {s['reason']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="accel-patch", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"accel-patch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser("env", help="versions, topology, decisions and patch status")
    env.add_argument("--json", action="store_true", help="one JSON object, for machines")
    # The demo parses its own options (its --help included).
    commands.add_parser("demo", help="fine-tune a small Llama with LoRA on this machine", add_help=False)
    args, rest = parser.parse_known_args(argv)

    if args.command == "demo":
        demo = importlib.import_module("accel_patch.demo")  # imports torch and transformers
        return int(demo.main(rest) or 0)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
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


if __name__ == "__main__":
    sys.exit(main())
