"""Which kernel ops a caller asks for: `swap_kernels(ops=...)`, ACCEL_PATCH_KERNELS, the config entry.

Pure Python (no torch): the kernels-at-load patch and the Trainer callback read the switch at
every load or Trainer, and `accel-patch config` checks the names a user types.
"""
from __future__ import annotations

import os

from . import families

#: The variable that chooses the ops swapped automatically (unset: all; `0`/`none`: off).
SWITCH = "ACCEL_PATCH_KERNELS"
OFF = ("0", "none", "off", "false", "no")


def resolve_ops(ops) -> tuple[str, ...]:
    """The op names `ops` asks for (None: all), in report order. ValueError names an unknown one."""
    if ops is None:
        return families.OPS
    if isinstance(ops, str):
        ops = ops.split(",")
    try:
        names = [str(o).strip().lower() for o in ops]
    except TypeError:
        raise ValueError(f"ops must be None, a comma-separated string or a list of op names among "
                         f"{', '.join(families.OPS)}, got {ops!r}") from None
    chosen = set()
    for written in filter(None, names):
        for name in families.expand(written):
            if name not in families.OPS:
                raise ValueError(f"unknown kernel op {name!r}: choose from {', '.join(families.OPS)} "
                                 f"(also {', '.join(sorted({**families.OP_ALIASES, **families.OP_GROUPS}))})")
            chosen.add(name)
    return tuple(op for op in families.OPS if op in chosen)


def ops_from_env(environ=None):
    """The ops ACCEL_PATCH_KERNELS asks for: None (all), () (off), or a tuple of names.
    Raises ValueError naming the variable when it names an unknown op."""
    env = os.environ if environ is None else environ
    raw = env.get(SWITCH, "").strip()
    if not raw:
        return None
    if raw.lower() in OFF:
        return ()
    try:
        return resolve_ops(raw)
    except ValueError as exc:
        raise ValueError(f"{source(SWITCH, raw)}: {exc}") from None


def source(name: str, raw: str) -> str:
    """How a complaint names a setting: the settings file that set it (the start-up hook says
    which, in `sys.accel_patch_settings`), else the environment variable, with its value."""
    import sys

    value, where = (getattr(sys, "accel_patch_settings", None) or {}).get(name, (None, None))
    return f"settings file {where}" if value is not None and value == raw else f"{name}={raw!r}"
