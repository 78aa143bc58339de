"""`accel-patch config`: the entry that loads accel-patch in every Python start of this environment.

Two files, never accelerate's own (unknown keys in accelerate's config make `accelerate launch` and
`accelerate env` fail):

- the settings, `accel_patch_config.yaml`, beside accelerate's `default_config.yaml`: in
  `$HF_HOME/accelerate/` (else `$XDG_CACHE_HOME/huggingface/accelerate/`, else
  `~/.cache/huggingface/accelerate/`), or beside the file `--config_file` names, as accelerate does;
- the start-up hook, `accel_patch_startup.pth`, in the site-packages of the environment accel-patch
  is installed in: one line that runs `startup_gate.py`'s text at every interpreter start. It is
  added to accel-patch's RECORD, so `pip uninstall accel-patch` removes it with the package.

`--remove` deletes both (and the RECORD line); nothing of accel-patch then runs at start-up.

The settings are shared by every environment that reads the same accelerate folder; each hook
belongs to one environment. So the folder also keeps `accel_patch_environments.txt`, the hooks
written for these settings, one path per line: `env`, `config --show` and `--remove` name the
environments they touch and those they leave (a hook left in another environment loads nothing
once the settings are gone, and says so in that environment's `accel-patch env`).
"""
from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

from ..swaps import families
from . import startup_gate

CONFIG_NAME = startup_gate.CONFIG_NAME
HOOK_NAME = "accel_patch_startup.pth"
ENVIRONMENTS_NAME = "accel_patch_environments.txt"
DISTRIBUTION = "accel-patch"
DEFAULTS = {"enabled": "true", "kernels": "all", "callback": "true"}
KERNEL_OPS = families.OPS


def accelerate_config_dir(config_file: str | None = None, environ=None) -> Path:
    """Where accelerate keeps its config: beside `config_file`, else under HF_HOME as accelerate does."""
    if config_file:
        return Path(config_file).expanduser().resolve().parent
    return Path(startup_gate.accelerate_dir(os.environ if environ is None else environ))


def config_path(config_file: str | None = None, environ=None) -> Path:
    return accelerate_config_dir(config_file, environ) / CONFIG_NAME


def environments_path(config_file: str | None = None) -> Path:
    """The list of the start-up hooks written for the settings of this accelerate folder."""
    return accelerate_config_dir(config_file) / ENVIRONMENTS_NAME


def environments(config_file: str | None = None) -> list[str]:
    """The hooks written for these settings that are still installed, this environment's included."""
    try:
        lines = environments_path(config_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    return [line for line in dict.fromkeys(l.strip() for l in lines) if line and Path(line).is_file()]


def _list_environments(hooks: list[str], config_file: str | None) -> None:
    path = environments_path(config_file)
    if hooks:
        path.write_text("".join(f"{h}\n" for h in hooks), encoding="utf-8")
    elif path.exists():
        path.unlink()


def _distribution():
    """The installed accel-patch: the one with a .dist-info RECORD (an egg-info left in a source
    checkout, found first when the checkout is the working directory, has none)."""
    found = None
    for dist in metadata.distributions(name=DISTRIBUTION):
        found = found or dist
        if any(f.name == "RECORD" for f in dist.files or ()):
            return dist
    if found is None:
        raise metadata.PackageNotFoundError(DISTRIBUTION)
    return found


def hook_path() -> Path:
    """The .pth file in the site-packages accel-patch is installed in."""
    return Path(_distribution().locate_file(HOOK_NAME))


def _record_file() -> Path | None:
    for f in _distribution().files or ():
        if f.name == "RECORD" and f.parent.name.endswith(".dist-info"):
            return Path(f.locate())
    return None


def _hook_line(extra_config_files: list[str]) -> str:
    # site executes a .pth line that starts with "import"; the hook runs in a namespace of its own
    source = startup_gate.hook_source(extra_config_files)
    return f"import sys; exec({source!r}, {{'__name__': 'accel_patch_startup'}})\n"


def _extra_files(line: str) -> list[str]:
    """The --config_file locations an installed hook line already knows."""
    import ast

    try:
        source = ast.literal_eval(line[line.index("exec(") + 5:line.rindex(", {")])
        assign = next(l for l in source.splitlines() if l.startswith("EXTRA = "))
        return list(ast.literal_eval(assign[len("EXTRA = "):]))
    except (ValueError, SyntaxError, StopIteration):
        return []


def write(settings: dict, config_file: str | None = None) -> tuple[Path, Path]:
    """Write the settings and the start-up hook; returns (settings file, hook file)."""
    path = config_path(config_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# accel-patch: read at every Python start by the hook `accel-patch config` installed.",
             "# Remove both with `accel-patch config --remove`.",
             *(f"{key}: {settings[key]}" for key in DEFAULTS)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    hook = hook_path()
    extra = _extra_files(hook.read_text(encoding="utf-8")) if hook.exists() else []
    if config_file and str(path) not in extra:
        extra.append(str(path))
    hook.write_text(_hook_line(extra), encoding="utf-8")
    _record(hook, add=True)
    _list_environments([*(h for h in environments(config_file) if h != str(hook)), str(hook)], config_file)
    return path, hook


def remove(config_file: str | None = None) -> tuple[list[Path], list[str]]:
    """Delete the settings file and this environment's start-up hook; returns (what was deleted,
    the hooks of other environments written for these settings that are still installed)."""
    hook = hook_path()
    others = [h for h in environments(config_file) if h != str(hook)]
    removed = []
    for path in (config_path(config_file), hook):
        if path.exists():
            path.unlink()
            removed.append(path)
    _record(hook, add=False)
    _list_environments([], config_file)  # the settings are gone: no hook is written for them any more
    return removed, others


def _record(hook: Path, add: bool) -> None:
    """List the hook in accel-patch's RECORD (so pip uninstall removes it), or take it out."""
    record = _record_file()
    if record is None:
        return
    entry = os.path.relpath(hook, record.parent.parent).replace(os.sep, "/")
    lines = [line for line in record.read_text(encoding="utf-8").splitlines() if line.split(",", 1)[0] != entry]
    if add:
        lines.append(f"{entry},,")
    record.write_text("\n".join(lines) + "\n", encoding="utf-8")


def read(config_file: str | None = None) -> dict | None:
    """The settings in the file (None when there is none). Raises ValueError naming the file when
    it is not UTF-8 text."""
    path = config_path(config_file)
    return startup_gate.read_settings(str(path)) if path.is_file() else None


def describe(config_file: str | None = None) -> dict:
    """What `accel-patch env` and `config --show` print: the settings, the hook, and this process."""
    path = config_path(config_file)
    try:
        hook = hook_path()
        hook_exists = hook.exists()
    except metadata.PackageNotFoundError:
        hook, hook_exists = None, False
    has_settings = path.is_file()
    try:
        settings, problem = read(config_file), None
    except (OSError, ValueError) as exc:  # env and config --show describe a bad file, never crash on it
        settings, problem = None, f"{exc}; accel-patch is not loaded at start-up (rewrite it: accel-patch config)"
    if has_settings and hook_exists:
        state, advice = "configured", None
    elif has_settings:
        # The settings are user-wide (beside accelerate's config); the hook belongs to one
        # environment: after `pip uninstall` elsewhere, or in a second venv, only the settings remain.
        state = "settings found, but this environment has no start-up hook: accel-patch does not load at start-up here"
        advice = ("run `accel-patch config --yes` to add the hook to this environment, or "
                  "`accel-patch config --remove` to delete the settings")
    elif hook_exists:
        state = "start-up hook installed, but no settings: it loads nothing"
        advice = "run `accel-patch config --yes` to write the settings, or `accel-patch config --remove` to delete the hook"
    else:
        state, advice = "not configured", None
    return {
        "config_file": str(path),
        "configured": has_settings and hook_exists,
        "state": state,
        "advice": advice,
        "settings": settings,
        "settings_file_exists": has_settings,
        "settings_problem": problem,
        "hook_file": str(hook) if hook else None,
        "hook_installed": hook_exists,
        "this_environment": sys.prefix,
        "other_environments": [h for h in environments(config_file) if h != str(hook)],
        "this_process": getattr(sys, "accel_patch_startup", "no start-up hook ran in this process"),
    }


# --- the questions of `accel-patch config` ---------------------------------------------------------

def _yes_no(answer: str, default: bool) -> bool | None:
    answer = answer.strip().lower()
    if not answer:
        return default
    return {"y": True, "yes": True, "true": True, "n": False, "no": False, "false": False}.get(answer)


def _kernels(answer: str) -> str | None:
    answer = answer.strip().lower().replace(" ", "")
    if answer in ("", "all"):
        return "all"
    if answer in ("none", "no", "off"):
        return "none"
    ops = [name for o in answer.split(",") if o for name in families.expand(o)]
    return ",".join(dict.fromkeys(ops)) if ops and all(o in KERNEL_OPS for o in ops) else None


QUESTIONS = (
    ("enabled", "Load accel-patch at the start of every Python process in this environment "
                "(python, torchrun, accelerate launch)? [YES/no]: ", lambda a: _yes_no(a, True), "yes or no"),
    ("kernels", f"Kernels to swap into models: all, none, or a comma list of {', '.join(KERNEL_OPS)} [all]: ",
     _kernels, f"all, none, or names among {', '.join(KERNEL_OPS)}"),
    ("callback", "Add AccelPatchCallback (kernels, tokens/s, step time, peak memory in the logs) to every "
                 "Trainer? [YES/no]: ", lambda a: _yes_no(a, True), "yes or no"),
)


def ask(input_fn=None, print_fn=print) -> dict:
    """The settings, asked one question at a time as `accelerate config` does (EOFError if stdin ends)."""
    import builtins

    input_fn = input_fn or builtins.input
    settings = {}
    for key, question, parse, valid in QUESTIONS:
        while True:
            value = parse(input_fn(question))
            if value is not None:
                break
            print_fn(f"  please answer {valid}")
        settings[key] = ("true" if value else "false") if isinstance(value, bool) else value
        if key == "enabled" and not value:
            settings.update(kernels=DEFAULTS["kernels"], callback=DEFAULTS["callback"])
            break
    return settings
