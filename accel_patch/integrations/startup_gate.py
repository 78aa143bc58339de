"""accel-patch's start-up hook: what the .pth line `accel-patch config` installs runs at every
interpreter start (plain python, each torchrun or accelerate-launch rank, the launchers themselves).

The line runs `hook_source()`: stdlib only. Unless accel-patch's config file exists (a few stat
calls) and says enabled, it imports nothing; it never raises (a half-uninstalled accel-patch must
not break every Python start); it runs once per process (site may process a venv's .pth twice);
ACCEL_PATCH_DISABLE=1 wins over the configuration. When configured it applies the settings as
accel-patch's switches (a variable already set wins) and imports accel_patch. What happened is
left in `sys.accel_patch_startup` for `accel-patch env`. The functions are defined once, in the
source below, and executed both here and in the hook.
"""
import os
import sys

CONFIG_NAME = "accel_patch_config.yaml"

_GATE = '''
def accelerate_dir(environ):
    """accelerate's rule for where its default_config.yaml lives: HF_HOME, else
    XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface, then accelerate/."""
    home = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "accelerate")


def config_file(environ, extra):
    """The accel-patch config file this process would use: ACCEL_PATCH_CONFIG_FILE, a --config_file
    location, or the one beside accelerate's default config."""
    for path in [environ.get("ACCEL_PATCH_CONFIG_FILE"), *extra, os.path.join(accelerate_dir(environ), "%s")]:
        if path and os.path.isfile(path):
            return path
    return None


def read_settings(path):
    """`key: value` lines of the config file (comments and blank lines skipped), values lower-cased."""
    settings = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if ":" in line:
                key, value = line.split(":", 1)
                settings[key.strip()] = value.strip().strip("'\\"").lower()
    return settings


def start(environ, extra):
    """Load accel_patch when configured and enabled; returns what happened, in one line."""
    if environ.get("ACCEL_PATCH_DISABLE", "").strip().lower() in ("1", "true", "yes"):
        return "off: ACCEL_PATCH_DISABLE is set"
    path = config_file(environ, extra)
    if path is None:
        return "off: not configured"
    settings = read_settings(path)
    if settings.get("enabled", "true") not in ("true", "yes", "1", "on"):
        return "off: %%s says enabled: %%s" %% (path, settings.get("enabled"))
    if settings.get("kernels", "all") not in ("all", ""):
        environ.setdefault("ACCEL_PATCH_KERNELS", settings["kernels"])
    if settings.get("callback", "true") in ("false", "no", "0", "off"):
        environ.setdefault("ACCEL_PATCH_CALLBACK", "0")
    import accel_patch
    return "on: accel_patch loaded at start-up (%%s)" %% path
''' % CONFIG_NAME

_RUN = '''
if getattr(sys, "accel_patch_startup", None) is None:
    sys.accel_patch_startup = "running"
    try:
        sys.accel_patch_startup = start(os.environ, EXTRA)
    except Exception as exc:
        sys.accel_patch_startup = "failed: %s: %s" % (type(exc).__name__, exc)
'''

exec(_GATE)  # accelerate_dir, config_file, read_settings, start: the hook's own definitions, for env and tests


def hook_source(extra_config_files) -> str:
    """The source the .pth line runs (docstrings and all: it is compiled once per start)."""
    return "import os, sys\n" + _GATE + f"EXTRA = {list(extra_config_files)!r}\n" + _RUN
