"""One reading for every on/off switch of accel-patch (ACCEL_PATCH_DISABLE and the per-patch
ACCEL_PATCH_ACCELERATE, _DEVICE_MAP, _CALLBACK, _TRL), for the switches that name one of a few
choices (`choice`: ACCEL_PATCH_EXPERTS_BACKWARD), and for those that give a size in bytes (`size`:
ACCEL_PATCH_EXPERTS_TILE_BUDGET).

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


#: The units `size` takes (binary: KiB = 1024 bytes), lower case; no unit is bytes.
SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
              "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def size(name: str, environ=None) -> float | None:
    """The variable `name` as a number of bytes: a number >= 0 with an optional binary unit
    ("512MiB", "2G", "1.5GiB", "0"; KiB = 1024 bytes), or "inf" (no bound); None when unset or
    blank; BadSwitch naming the variable, its value and the valid forms otherwise."""
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    value = raw.strip().lower().replace(" ", "")
    if value == "inf":
        return float("inf")
    number = value.rstrip("kmgtib")
    unit = value[len(number):]
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in SIZE_UNITS or not 0 <= amount < float("inf"):
        raise BadSwitch(f"{name}={raw!r} is not a size: use a number of bytes >= 0 with an optional unit "
                        f"(K/KiB, M/MiB, G/GiB, T/TiB; e.g. 512MiB, 2GiB), or inf, or leave it unset")
    return amount * SIZE_UNITS[unit]
