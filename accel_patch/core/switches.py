"""One reading for every on/off switch of accel-patch (ACCEL_PATCH_DISABLE and the per-patch
ACCEL_PATCH_ACCELERATE, _DEVICE_MAP, _CALLBACK, _TRL), and for the switches that name one of a few
choices (`choice`: ACCEL_PATCH_EXPERTS_BACKWARD).

The usual spellings, case-insensitive: 1/true/yes/on/y/t/enable(d) and 0/false/no/off/n/f/disable(d);
blank or unset means the default. Any other value is an error that names the variable, its value
and the valid ones. Pure Python, no torch: `import accel_patch` reads ACCEL_PATCH_DISABLE.
What a bad value does is the caller's: a safety switch (the distributed set-up, the device map)
stops at its decision point; the rest warn and keep their default.
"""
from __future__ import annotations

import os

TRUE = ("1", "true", "yes", "on", "y", "t", "enable", "enabled")
FALSE = ("0", "false", "no", "off", "n", "f", "disable", "disabled")


class BadSwitch(ValueError):
    """A switch set to a value that is neither a true nor a false spelling."""


def read(name: str, environ=None) -> bool | None:
    """True or False as the variable `name` says, None when unset or blank; BadSwitch otherwise."""
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise BadSwitch(f"{name}={raw!r} is not a switch value: use one of {'/'.join(TRUE[:4])} or "
                    f"{'/'.join(FALSE[:4])} (any case), or leave it unset")


def turned_off(name: str, environ=None) -> bool:
    """Whether a per-patch switch turns its patch off (`=0`, `=false`, `=off`, ...). BadSwitch
    on a value that is neither."""
    return read(name, environ) is False


def choice(name: str, valid: tuple[str, ...], environ=None) -> str | None:
    """The variable `name`'s value among `valid` (case-insensitive, stripped), None when unset or
    blank; BadSwitch naming the variable, its value and the valid ones otherwise."""
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    value = raw.strip().lower()
    if value in valid:
        return value
    raise BadSwitch(f"{name}={raw!r} is not one of {', '.join(valid)} (any case), or leave it unset")
