"""Fixtures and markers shared by every test under tests/.

- Triton runs under its interpreter in this process (kernel tests here and model-level tests
  that swap kernels run on CPU tensors); it must be chosen before triton is imported. Processes
  that tests start do not inherit it (tests/_env.py, `child_env`). On a GPU machine run with
  TRITON_INTERPRET=0.
- `launcher_free_env` (autouse): no test inherits the host's launcher variables, and each leaves
  os.environ as it found it.
- `fake_accelerators`: the local accelerator count accel-patch sees, faked.
- `gpu` tests are skipped, with the reason, where torch sees no CUDA device.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import inspect  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402


def _patch_the_language_once_per_launch() -> None:
    """Triton's interpreter patches triton.language when a kernel launches (`GridExecutor`, undone
    when it returns) and again at every call of a @jit helper made inside the kernel (`_round`,
    `_factors`, ...: once per program and call), each time listing every member of tl, tl.core,
    tl.tensor and tl.math with `inspect.getmembers` to find the builtins: a fifth of the quick
    loop's profile (cProfile of `pytest -m "not slow"`; the kernel files run 15-25% faster
    without it). A helper's pass inside a launch
    changes nothing the launch's own pass did not (its builtins are patched already; the rest it
    sets again to equal stand-ins, and the launch's scope puts back the originals), so it is
    skipped where the helper sees no language module the launch did not patch. And which members
    are builtins never changes, so their names are listed once per package; every pass still
    patches exactly the members that are builtins at that moment, in the same order, as the
    interpreter's own `_patch_builtin`. Where triton's interpreter lacks these functions, nothing is
    changed."""
    try:
        import triton.language as tl
        from triton.language.core import is_builtin
        from triton.runtime import interpreter

        patch_attr, patch_lang = interpreter._patch_attr, interpreter._patch_lang
        launch, helper, scope_type = interpreter.GridExecutor, interpreter.InterpretedFunction, interpreter._LangPatchScope
        interpreter._patch_builtin  # noqa: B018 (replaced below)
    except (ImportError, AttributeError):
        return
    names: dict = {}
    languages: dict = {}
    launches: list = []  # the language modules each launch under way patched

    def _patch_builtin(pkg, builder, scope):
        if pkg not in names:
            names[pkg] = [name for name, member in inspect.getmembers(pkg) if is_builtin(member)]
        for name in names[pkg]:
            member = getattr(pkg, name, None)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    def _patch_lang(fn):
        if fn not in languages:
            languages[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        caller = sys._getframe(1).f_locals.get("self")
        if isinstance(caller, helper) and launches and languages[fn] <= launches[-1]:
            return scope_type()
        scope = patch_lang(fn)
        if isinstance(caller, launch):
            launches.append(languages[fn])
            restore = scope.restore

            def restore_and_end():
                launches.pop()
                restore()

            scope.restore = restore_and_end
        return scope

    interpreter._patch_builtin = _patch_builtin
    interpreter._patch_lang = _patch_lang


if os.environ["TRITON_INTERPRET"] == "1":
    _patch_the_language_once_per_launch()

from _env import is_launcher_variable  # noqa: E402
from accel_patch.core import topology_resolver  # noqa: E402


@pytest.fixture(autouse=True)
def launcher_free_env():
    """Every test starts without the host's launcher variables (they would change the topology it
    tests) and leaves os.environ exactly as it was, whatever the code under test wrote there
    (accel-patch removes blank variables and exports RANK/WORLD_SIZE by design)."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if is_launcher_variable(n)]:
        del os.environ[name]
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def fake_accelerators(monkeypatch):
    """fake_accelerators(count, kind="cuda"): accel-patch's topology sees `count` local
    accelerators of `kind` (none until called), so a test runs the same on a CPU box and a GPU
    box. Only what accel-patch asks is faked: torch itself still sees the real devices."""

    def fake(count: int, kind: str = "cuda") -> None:
        monkeypatch.setattr(topology_resolver, "local_accelerators", lambda: (kind if count else "cpu", count))

    fake(0)
    return fake


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    # An audit test is slow by nature: the quick loop's `-m "not slow"` replaces addopts'
    # `-m 'not audit'`, so an audit test not also slow would run there (minutes).
    for item in items:
        if item.get_closest_marker("audit"):
            item.add_marker(pytest.mark.slow)
    needs_gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not needs_gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False here")
    for item in needs_gpu:
        item.add_marker(skip)


#: `pytest -n auto` (README's command) runs one worker per core, at most this many: each worker
#: imports torch and transformers, and the launch tests start two ranks of their own.
MAX_AUTO_WORKERS = 4


@pytest.hookimpl(optionalhook=True)  # where pytest-xdist is not installed (the GPU image) the hook is unknown
def pytest_xdist_auto_num_workers(config):
    return max(1, min(MAX_AUTO_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


def pytest_configure(config):
    # a worker of `pytest -n`: one intra-op thread each, so that the workers share the cores instead
    # of spinning on each other's (the processes the tests start keep the default)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
