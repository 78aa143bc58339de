"""accel-patch's start-up hook: what the .pth line `accel-patch config` installs runs at every
interpreter start (plain python, each torchrun or accelerate-launch rank, the launchers themselves).

The line runs `hook_source()`: stdlib only. Unless accel-patch's config file exists (a few stat
calls) and says enabled, it imports nothing; it never raises (a half-uninstalled accel-patch must
not break every Python start, nor write into every process's output: `accel-patch env` says
what failed); a bad settings file or value is one line on stderr naming the file, the key, the
value, the valid values and what happens instead; it runs once per process (site may process a venv's .pth twice);
ACCEL_PATCH_DISABLE=1 wins over the configuration. When configured it applies the settings as
accel-patch's switches (a variable already set wins) and imports accel_patch. What happened is
left in `sys.accel_patch_startup` for `accel-patch env`. The functions are defined once, in the
source below, and executed both here and in the hook.
"""
import os
import sys

CONFIG_NAME = "accel_patch_config.yaml"
# core/switches.py's spellings (that module is not importable from the hook: the hook is stdlib-only)
TRUE_SWITCH = ("1", "true", "yes", "on", "y", "t", "enable", "enabled")
FALSE_SWITCH = ("0", "false", "no", "off", "n", "f", "disable", "disabled")

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


TRUE = ("true", "yes", "1", "on")
FALSE = ("false", "no", "0", "off")
KEYS = ("enabled", "kernels", "callback")
# the on/off spellings of accel_patch.core.switches (this source is stdlib-only: written out here)
TRUE_SWITCH = %r
FALSE_SWITCH = %r


def read_settings(path):
    """`key: value` lines of the config file (comments and blank lines skipped), values lower-cased.
    Raises ValueError naming the file when its bytes are not UTF-8 text."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError("%%s is not UTF-8 text (byte 0x%%02x at offset %%d)" %% (path, data[exc.start], exc.start)) from None
    settings = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if ":" in line:
            key, value = line.split(":", 1)
            settings[key.strip()] = value.strip().strip("'\\"").lower()
    return settings


def say(line):
    """One line on stderr: the hook never raises and never stays silent about a bad file."""
    try:
        sys.stderr.write("accel-patch: %%s\\n" %% line)
    except Exception:
        pass


def start(environ, extra):
    """Load accel_patch when configured and enabled; returns what happened, in one line. A bad
    file or value is said on stderr (the file, the key, the value, the valid values, what happens)."""
    disable = environ.get("ACCEL_PATCH_DISABLE", "").strip().lower()
    if disable in TRUE_SWITCH:
        return "off: ACCEL_PATCH_DISABLE is set"
    if disable and disable not in FALSE_SWITCH:  # accel_patch's own import says it too, and stays off
        say("ACCEL_PATCH_DISABLE=%%r is not a switch value (use 1/true/yes/on or 0/false/no/off); "
            "accel-patch is not loaded" %% environ["ACCEL_PATCH_DISABLE"])
        return "off: ACCEL_PATCH_DISABLE has a bad value"
    path = config_file(environ, extra)
    if path is None:
        return "off: not configured"
    try:
        settings = read_settings(path)
    except (OSError, ValueError) as exc:
        say("%%s; accel-patch is not loaded at start-up (fix or rewrite it: accel-patch config)" %% exc)
        return "off: %%s" %% exc
    for key in settings:
        if key not in KEYS:
            say("%%s: unknown key %%r (valid keys: %%s): ignored" %% (path, key, ", ".join(KEYS)))
    enabled = settings.get("enabled", "true")
    if enabled in FALSE:
        return "off: %%s says enabled: %%s" %% (path, enabled)
    if enabled not in TRUE:
        say("%%s: enabled: %%r is not valid (true or false): accel-patch is not loaded at start-up" %% (path, enabled))
        return "off: %%s says enabled: %%s, which is not true or false" %% (path, enabled)
    if settings.get("kernels", "all") not in ("all", ""):
        environ.setdefault("ACCEL_PATCH_KERNELS", settings["kernels"])
        if environ["ACCEL_PATCH_KERNELS"] == settings["kernels"]:  # named by the file in any complaint
            sys.accel_patch_settings = {"ACCEL_PATCH_KERNELS": (settings["kernels"], "%%s (kernels: %%s)" %% (
                path, settings["kernels"]))}
    callback = settings.get("callback", "true")
    if callback in FALSE:
        environ.setdefault("ACCEL_PATCH_CALLBACK", "0")
    elif callback not in TRUE:
        say("%%s: callback: %%r is not valid (true or false): the callback stays on (the default)" %% (path, callback))
    import accel_patch
    return "on: accel_patch loaded at start-up (%%s)" %% path
''' % (CONFIG_NAME, TRUE_SWITCH, FALSE_SWITCH)

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
