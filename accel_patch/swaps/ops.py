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


def split_known(raw: str) -> tuple[tuple[str, ...], list[str]]:
    """(the known ops `raw` names, in report order; the names it writes that are no op)."""
    known, unknown = set(), []
    for written in filter(None, (w.strip().lower() for w in raw.split(","))):
        names = families.expand(written)
        if all(n in families.OPS for n in names):
            known.update(names)
        else:
            unknown.append(written)
    return tuple(op for op in families.OPS if op in known), unknown


def bad_names(environ=None) -> str | None:
    """What is wrong with ACCEL_PATCH_KERNELS (the unknown names, what runs instead, the valid
    names), or None when every name is an op (`accel-patch env` and `check` show it)."""
    env = os.environ if environ is None else environ
    raw = env.get(SWITCH, "").strip()
    if not raw or raw.lower() in OFF:
        return None
    known, unknown = split_known(raw)
    if not unknown:
        return None
    return (f"{source(SWITCH, raw)}: unknown kernel op(s) {', '.join(map(repr, unknown))}, skipped; swapping "
            f"{', '.join(known) if known else 'no kernel'} (choose from {', '.join(families.OPS)}; also "
            f"{', '.join(sorted({**families.OP_ALIASES, **families.OP_GROUPS}))})")


_warned: set[str] = set()


def ops_from_env(environ=None):
    """The ops ACCEL_PATCH_KERNELS asks for: None (all), () (off), or a tuple of names. A name
    that is no op is warned about (once per value, with the valid names) and skipped: the rest run."""
    env = os.environ if environ is None else environ
    raw = env.get(SWITCH, "").strip()
    if not raw:
        return None
    if raw.lower() in OFF:
        return ()
    known, unknown = split_known(raw)
    if unknown and raw not in _warned:
        import logging

        _warned.add(raw)
        logging.getLogger("accel_patch").warning("accel_patch: %s", bad_names(env))
    return known


def source(name: str, raw: str) -> str:
    """How a complaint names a setting: the settings file that set it (the start-up hook says
    which, in `sys.accel_patch_settings`), else the environment variable, with its value."""
    import sys

    value, where = (getattr(sys, "accel_patch_settings", None) or {}).get(name, (None, None))
    return f"settings file {where}" if value is not None and value == raw else f"{name}={raw!r}"
