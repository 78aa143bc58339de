"""Linear-attention and SSM mixers: no accel-patch op, but named in the report with what runs there.

Gated DeltaNet (Qwen3.5, Qwen3-Next, Olmo hybrid), KDA (Kimi Linear, GLM-5-next), Mamba2
(Nemotron-H, Granite 4 hybrids, Falcon-H1) and short convolutions (LFM2, LFM3) carry a large part
of a hybrid layer's weights and most of its step time. transformers picks their kernels once, at
import, through `use_kernel_func_from_hub_with_fallback`: the original package when it is
installed (flash-linear-attention, causal-conv1d, mamba-ssm), else its torch reference (correct,
much slower), and warns once. The report says, per mixer class, which of the two each of its
functions holds, and the package that brings the kernel: read from the wrapper itself, not
guessed from what is installed.
"""
from __future__ import annotations

import importlib
import inspect
import re
import sys

#: Packages transformers falls back from -> the pip distribution that brings the kernel.
DISTRIBUTIONS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm"}


def _fallback_parts(func):
    """(function name, package, implementation, torch reference) of a transformers fallback
    wrapper (read from its closure; from transformers 5.25 that wrapper sits inside the `kernels`
    package's hub wrapper), else None."""
    from .. import sites

    func = sites.python_function(func) if func is not None else None
    seen = 0
    while func is not None and seen < 8:
        code = getattr(func, "__code__", None)
        if code is not None and func.__closure__ and {"implementation", "torch_function", "package"} <= set(code.co_freevars):
            cells = dict(zip(code.co_freevars, (c.cell_contents for c in func.__closure__)))
            return cells.get("func_name"), cells["package"], cells["implementation"], cells["torch_function"]
        func, seen = getattr(func, "__wrapped__", None), seen + 1
    return None


def _class_names(cls, owner) -> set[str]:
    """Every global name the methods of `cls` (and its bases in the same module) refer to, and
    the names referred to by the module-level functions of `owner` that those wrap with the
    `kernels` package's hub wrapper (from transformers 5.25 a mixer calls e.g.
    `causal_conv1d_forward`, whose function calls the fallback-wrapped `causal_conv1d_fn`)."""
    from .. import sites

    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__ != cls.__module__:
            continue
        for value in vars(klass).values():
            code = getattr(inspect.unwrap(value), "__code__", None) if callable(value) else None
            if code is not None:
                names.update(code.co_names)
    pending = list(names)
    while pending:
        value = owner.__dict__.get(pending.pop())
        inner = sites.python_function(value) if value is not None else None
        if inner is not value and getattr(inner, "__module__", None) == owner.__name__:
            new = set(inner.__code__.co_names) - names
            names |= new
            pending.extend(new)
    return names


def what_runs(module) -> str | None:
    """What runs in this module's mixer functions, grouped by package ("torch reference, no
    flash-linear-attention (pip install flash-linear-attention): chunk_gated_delta_rule, ..."),
    or None when it has none."""
    cls = type(module)
    owner = sys.modules.get(cls.__module__)
    if owner is None:
        return None
    groups: dict[tuple[str, bool], list[str]] = {}
    for name in sorted(_class_names(cls, owner)):
        found = _fallback_parts(owner.__dict__.get(name))
        if found is None:
            continue
        func_name, package, implementation, torch_function = found
        groups.setdefault((package, implementation is torch_function), []).append(func_name or name)
    parts = []
    for (package, reference), names in sorted(groups.items()):
        dist = DISTRIBUTIONS.get(package, package)
        if reference:
            parts.append(f"torch reference, no {dist} (pip install {dist}): {', '.join(names)}")
        else:
            parts.append(f"{dist}'s kernels: {', '.join(names)}")
    return "; ".join(parts) or None


def census(model) -> dict[str, tuple[int, str]]:
    """Mixer class name -> (modules, what runs there), for every mixer of `model`."""
    found: dict[str, tuple[int, str]] = {}
    known: dict[type, str | None] = {}
    for module in model.modules():
        cls = type(module)
        if cls not in known:
            try:
                known[cls] = what_runs(module)
            except Exception:  # a class we cannot read is not named, never raised
                known[cls] = None
        if known[cls]:
            n, _ = found.get(cls.__name__, (0, known[cls]))
            found[cls.__name__] = (n + 1, known[cls])
    return found


#: A decorated mixer function in a modeling file: (the package it falls back from, the function's name).
_DECORATED = re.compile(r'@use_kernel_func_from_hub_with_fallback\(\s*"\w+",\s*"(\w+)"[^)]*\)\s*\n'
                        r'(?:\s*@[^\n]*\n)*\s*def (\w+)')


def kinds() -> dict[str, tuple[list[str], str]]:
    """Package transformers falls back from -> (the model families whose mixers use it, what runs
    there now), for this transformers: the families found in its modeling files' decorators, what
    runs read from the wrapper of the first family (transformers decides per package, at import:
    every family gets the same)."""
    import transformers.models as models
    from pathlib import Path

    families: dict[str, dict[str, list[str]]] = {}  # package -> family -> decorated function names
    for path in sorted(Path(models.__file__).parent.glob("*/modeling_*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for package, func_name in _DECORATED.findall(text):
            families.setdefault(package, {}).setdefault(path.parent.name, []).append(func_name)
    found = {}
    for package, by_family in sorted(families.items()):
        dist = DISTRIBUTIONS.get(package, package)
        family, names = next(iter(by_family.items()))
        what = f"not read: transformers.models.{family} did not import"
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except Exception:
            module = None
        if module is not None:
            read = [_fallback_parts(module.__dict__.get(n)) for n in dict.fromkeys(names)]
            read = [r for r in read if r is not None]
            if read and all(impl is ref for _, _, impl, ref in read):
                what = f"torch reference, no {dist} (pip install {dist})"
            elif read:
                what = f"{dist}'s kernels"
            else:
                what = "not read: no fallback wrapper found"
        found[package] = (sorted(by_family), what)
    return found
