"""`accel-patch env [--json]`: versions, the topology with `topology().sources` (where each value
came from), the decision for accelerate's state and the device map (or the sharding engine that
places the weights instead), the config entry, and
`status()`. A bad launcher variable is a one-line error and exit code 2, never a traceback.
"""
from __future__ import annotations

import json
import sys

from .. import __version__
from ..core.topology_resolver import TopologyError
from .report import FIELDS, env_report


def add_parser(commands):
    parser = commands.add_parser("env", help="versions, topology, decisions and patch status")
    parser.add_argument("--json", action="store_true", help="one JSON object, for machines")
    return parser


def run(args) -> int:
    try:
        report = env_report()
    except TopologyError as exc:
        print(f"accel-patch: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


def print_report(report: dict) -> None:
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
    print(f"  {report['load']['reason']}")
    entry = report["config_entry"]
    settings = ", ".join(f"{k}: {v}" for k, v in (entry["settings"] or {}).items())
    print(f"\nconfig entry (accel-patch config): {entry['state']}")
    if entry.get("settings_problem"):
        found = f"unreadable: {entry['settings_problem']}"
    elif settings:
        found = settings
    else:
        found = "empty: the defaults" if entry.get("settings_file_exists") else "absent"
    print(f"  settings   {entry['config_file']} ({found})")
    print(f"  start-up   {entry['hook_file']} ({'installed' if entry['hook_installed'] else 'absent'}; "
          f"this environment: {entry['this_environment']})")
    for hook in entry.get("other_environments") or ():
        print(f"  also read by the start-up hook {hook}")
    print(f"  this process: {entry['this_process']}")
    if entry["advice"]:
        print(f"  {entry['advice']}")
    if report.get("kernel_list_problem"):
        print(f"\nkernels: {report['kernel_list_problem']}")
    print(f"\npatches\n  {'NAME':<17} {'STATE':<9} REASON")
    for s in report["status"]:
        print(f"  {s['name']:<17} {s['state']:<9} {s['reason']}")
