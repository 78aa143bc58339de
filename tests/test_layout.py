"""The package's rooms and the direction of their imports, read from the source.

    cli (and the -m accel_patch.demo entry)   may import every room and the package root
    the package root (accel_patch/__init__)   core, patches, integrations, swaps
    integrations, patches                     swaps and core (never each other)
    swaps                                     core
    core                                      no other room

Inside swaps/, the walk and the shared machinery sit at the top and each kind of site has a room:

    swaps.apply (the walk)                    every module of swaps
    swaps.lora                                the shared machinery and swaps.layers (its MLP
                                              builds on the gated-MLP kernel)
    swaps.experts                             the shared machinery and swaps.layers (the activation
                                              an MLP declares, the tiled MLP's rule)
    every other room (layers, loss, ...)      the shared machinery only
    the shared machinery (probe, sites, ...)  no room

accel_kernels imports nothing of accel_patch, transformers or accelerate. No module imports
itself back through others (no circle), lazy imports inside functions included.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import accel_patch
import accel_kernels

PACKAGE = Path(accel_patch.__file__).resolve().parent
KERNELS = Path(accel_kernels.__file__).resolve().parent

ROOMS = ("core", "swaps", "patches", "integrations", "cli")
#: room -> the rooms it may import (itself included)
ALLOWED = {
    "core": {"core"},
    "swaps": {"swaps", "core"},
    "patches": {"patches", "swaps", "core"},
    "integrations": {"integrations", "swaps", "core"},
    "cli": {"cli", "integrations", "patches", "swaps", "core", "root"},
    "root": {"root", "integrations", "patches", "swaps", "core"},
}
#: files outside the rooms that belong to one by role
FACE_ENTRIES = {"accel_patch.demo"}  # the `python -m accel_patch.demo` entry: the CLI's demo

SWAPS = PACKAGE / "swaps"
#: the top of swaps/: the walk (apply) and the machinery every room shares
SWAPS_TOP = {"apply", "families", "ops", "probe", "report", "sites"}
SWAPS_MAX_TOP_MODULES = 8  # __init__ included: a new kind of site gets a room, not a top module
#: swaps room -> the swaps rooms it may import besides the shared machinery
SWAPS_ALLOWED = {"lora": {"layers"}, "experts": {"layers"}}


def module_sources(top: Path, name: str) -> dict[str, str]:
    """{dotted module name: source} of every .py file of the package at `top`."""
    found = {}
    for path in sorted(top.rglob("*.py")):
        parts = [name, *path.relative_to(top).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path.read_text(encoding="utf-8")
    return found


@functools.lru_cache(maxsize=None)
def parsed(source: str) -> ast.Module:
    """A source's tree, parsed once: every test of this file walks the same few hundred sources
    (read-only), each with one or two of them changed."""
    return ast.parse(source)


def imports_of(module: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that `module` imports anywhere in its source (lazy imports too)."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(parsed(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a non-module name: its module
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def graph(sources: dict[str, str], packages: set[str]) -> dict[str, set[str]]:
    known = set(sources)
    return {m: imports_of(m, s, m in packages, known) for m, s in sources.items()}


def room_of(module: str) -> str:
    if module in FACE_ENTRIES:
        return "cli"
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    if parts[1] not in ROOMS:
        raise AssertionError(f"{module} lives in no room: move it into one of {', '.join(ROOMS)}")
    return parts[1]


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Imports that run the wrong way, and circles."""
    wrong = []
    for module, targets in edges.items():
        room = room_of(module)
        for target in sorted(targets):
            if target.split(".")[0] != "accel_patch":
                continue
            if room_of(target) not in ALLOWED[room]:
                wrong.append(f"{module} ({room}) imports {target} ({room_of(target)})")
    return wrong + [f"import circle: {' -> '.join(c)}" for c in circles(edges)]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules (Tarjan), as a path."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group) + [sorted(group)[0]])

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def package_graph():
    sources = module_sources(PACKAGE, "accel_patch")
    packages = {m for m in sources if (PACKAGE / Path(*m.split(".")[1:]) / "__init__.py").exists()}
    return sources, graph(sources, packages)


def test_every_module_lives_in_a_room_and_imports_run_downward():
    _, edges = package_graph()
    assert violations(edges) == []


def test_an_upward_import_or_a_circle_is_caught():
    # The checker itself, on the real sources with one line added: it must go red.
    sources, _ = package_graph()
    packages = {m for m in sources if (PACKAGE / Path(*m.split(".")[1:]) / "__init__.py").exists()}
    for module, line, expected in [
        ("accel_patch.core.device_map", "from ..patches import model_loading\n", "core.device_map (core) imports"),
        ("accel_patch.swaps.probe", "def f():\n    from ..integrations import callback\n", "(swaps) imports"),
        ("accel_patch.patches.model_loading", "from ..integrations.callback import x\n", "(patches) imports"),
        ("accel_patch.integrations.callback", "from ..patches import accelerate_state\n", "(integrations) imports"),
        ("accel_patch.core.registry", "import accel_patch\n", "(core) imports accel_patch (root)"),
        ("accel_patch.swaps.sites", "from . import apply\n", "import circle"),
    ]:
        broken = dict(sources, **{module: sources[module] + line})
        found = violations(graph(broken, packages))
        assert any(expected in v for v in found), (module, line, found)


def test_the_kernel_library_imports_nothing_of_accel_patch_or_the_hf_stack():
    sources = module_sources(KERNELS, "accel_kernels")
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                assert top not in ("accel_patch", "transformers", "accelerate", "peft", "trl"), (
                    f"{module} imports {name}")


def swaps_room_of(module: str) -> str | None:
    """The room of a module of accel_patch.swaps: a subfolder's name, "top" for the shared
    machinery, "walk" for apply, None outside swaps/ or for the package itself."""
    parts = module.split(".")
    if parts[:2] != ["accel_patch", "swaps"] or len(parts) == 2:
        return None
    if len(parts) == 3 and parts[2] in SWAPS_TOP:
        return "walk" if parts[2] == "apply" else "top"
    return parts[2]


def swaps_violations(edges: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in edges.items():
        room = swaps_room_of(module)
        if room in (None, "walk"):
            continue
        for target in sorted(targets):
            there = swaps_room_of(target)
            if there in (None, "top", room):
                continue
            if room == "top" or there not in SWAPS_ALLOWED.get(room, set()):
                wrong.append(f"{module} ({room}) imports {target} ({there})")
    return wrong


def test_swaps_keeps_the_walk_and_the_shared_machinery_at_the_top_and_sites_in_rooms():
    tops = sorted(p.name for p in SWAPS.glob("*.py"))
    assert len(tops) <= SWAPS_MAX_TOP_MODULES, f"swaps/ has {len(tops)} top modules: {tops}"
    assert {p.stem for p in SWAPS.glob("*.py")} - {"__init__"} <= SWAPS_TOP, tops
    assert sorted(p.parent.name for p in SWAPS.glob("*/__init__.py")), "swaps/ has no rooms"
    _, edges = package_graph()
    assert swaps_violations(edges) == []


def test_a_swaps_room_importing_another_room_or_the_machinery_importing_a_room_is_caught():
    sources, _ = package_graph()
    packages = {m for m in sources if (PACKAGE / Path(*m.split(".")[1:]) / "__init__.py").exists()}
    for module, line, expected in [
        ("accel_patch.swaps.layers.norms", "from ..loss import head\n", "(layers) imports accel_patch.swaps.loss.head"),
        ("accel_patch.swaps.loss.head", "from ..lora import plans\n", "(loss) imports"),
        ("accel_patch.swaps.probe", "def f():\n    from .layers import mlp\n", "(top) imports"),
    ]:
        broken = dict(sources, **{module: sources[module] + line})
        found = swaps_violations(graph(broken, packages))
        assert any(expected in v for v in found), (module, line, found)


def test_tests_of_swaps_mirror_its_rooms():
    tests = Path(__file__).resolve().parent / "swaps"
    for room in sorted(p.parent.name for p in SWAPS.glob("*/__init__.py")):
        assert list((tests / room).glob("test_*.py")), f"tests/swaps/{room}/ has no tests for accel_patch/swaps/{room}/"


def test_every_package_directory_is_listed_in_pyproject():
    # setuptools installs only the packages pyproject lists: a room missing there works in an
    # editable install and is absent from a wheel
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    found = {".".join(("accel_patch", *p.parent.relative_to(PACKAGE).parts)) for p in PACKAGE.rglob("__init__.py")}
    found |= {".".join(("accel_kernels", *p.parent.relative_to(KERNELS).parts)) for p in KERNELS.rglob("__init__.py")}
    assert found - listed == set(), f"packages missing from pyproject's [tool.setuptools] packages: {sorted(found - listed)}"
