"""``tensordiff capture --mindformers``: run a MindFormers Trainer command with the ``TensordiffCapture`` callback.

``mindformers_command(cmd, steps)`` takes ``python run_mindformer.py --config x.yaml ARGS`` (or ``msrun [OPTIONS]
run_mindformer.py ...``, anything whose arguments hold ``--config FILE``), writes a copy of the YAML with the callback
appended to its ``callbacks`` (``tensordiff capture`` writes it next to the capture, as ``FILE.mindformers.yaml``:
the user's file is never written), and returns the command with
``--config`` pointing at the copy and the environment it needs. The callback is registered through MindFormers' own
``auto_register`` key: ``REGISTER_DIR--tensordiff_capture.TensordiffCapture`` (the folder named in the key, so a
``--register_path`` of the user's own stays as it is); ``REGISTER_PATH`` is set only where nothing sets it (MindFormers
refuses ``auto_register`` without one). Output and steps come from ``tensordiff capture`` (``TENSORDIFF_OUTPUT``...).
"""

from __future__ import annotations

import difflib
import os
import shlex
import tempfile
from typing import Any

from .._yaml import load_yaml
from ..errors import MappingError, UsageError
from .mindformers_register import NAME, REGISTER_DIR, REGISTER_MODULE

__all__ = ["mindformers_command", "near_misses"]


def _config_index(cmd: list[str]) -> tuple[int, str]:
    """(index of the value, the value) of the command's ``--config FILE`` / ``--config=FILE``."""
    for i, arg in enumerate(cmd):
        if arg == "--config":
            if i + 1 >= len(cmd) or cmd[i + 1].startswith("-"):
                break
            return i + 1, cmd[i + 1]
        if arg.startswith("--config="):
            return i, arg.split("=", 1)[1]
    raise UsageError(f"--mindformers: `{shlex.join(cmd)}` has no --config FILE; write the command as "
                     "`python run_mindformer.py --config x.yaml ARGS` (or with msrun [OPTIONS] in front)")


def _script_dir(cmd: list[str], at: int) -> str:
    """Where run_mindformer.py resolves a relative --config: its own folder (the first .py before --config)."""
    script = next((a for a in cmd[:at] if a.endswith(".py")), None)
    return os.path.dirname(os.path.abspath(script)) if script else os.getcwd()


def near_misses(entries: Any) -> list[str]:
    """The ``type`` names of ``callbacks`` entries that look like a misspelt ``TensordiffCapture``."""
    found = []
    for entry in entries if isinstance(entries, list) else []:
        name = entry.get("type") if isinstance(entry, dict) else None
        if not isinstance(name, str) or name == NAME:
            continue
        ratio = difflib.SequenceMatcher(None, name.lower(), NAME.lower()).ratio()
        if ratio >= 0.8 or "tensordiff" in name.lower():
            found.append(name)
    return found


def _read_config(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise UsageError(f"--mindformers: {path}: no such config file; pass the training YAML with --config")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"--mindformers: {path}: cannot read the config ({err}); pass the training YAML") from None
    try:
        config = load_yaml(text, path, "MindFormers config")
    except MappingError as err:
        raise UsageError(f"--mindformers: {err} (--config)") from None
    if not isinstance(config, dict):
        raise UsageError(f"--mindformers: {path}: not a MindFormers config (a YAML mapping of sections expected, got "
                         f"{type(config).__name__}); pass the training YAML with --config")
    return config


def mindformers_command(cmd: list[str], copy: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The command with ``--config`` on a patched copy of its YAML (written to ``copy``; default: a new temporary
    folder), and the environment to add.
 A UsageError when the command has no
    ``--config``, the file is missing or is not YAML, or its ``callbacks`` name a near-miss of ``TensordiffCapture``.
    """
    at, value = _config_index(cmd)
    path = value if os.path.isabs(value) else os.path.join(_script_dir(cmd, at), value)
    if not os.path.isfile(path) and os.path.isfile(value):
        path = os.path.abspath(value)  # relative to the working folder (a script that resolves it so)
    config = _read_config(path)
    callbacks = config.get("callbacks") or []
    if not isinstance(callbacks, list):
        raise UsageError(f"--mindformers: {path}: `callbacks` is a {type(callbacks).__name__}, not a list of "
                         "`- type: NAME` entries; fix the config")
    wrong = near_misses(callbacks)
    if wrong:
        raise UsageError(f"--mindformers: {path}: callbacks entry `type: {wrong[0]}` is not a known callback; did you "
                         f"mean `type: {NAME}`? (or remove it: --mindformers adds the callback itself)")
    if "--" in REGISTER_DIR:
        raise UsageError(f"--mindformers: tensordiff is installed under {REGISTER_DIR}, a path with '--' in it, which "
                         "MindFormers' auto_register cannot name; install tensordiff elsewhere")
    key = f"{REGISTER_DIR}--{REGISTER_MODULE}.{NAME}"
    own = [c for c in callbacks if isinstance(c, dict) and c.get("type") == NAME]
    for c in own:  # the user's entry keeps its options (output and steps: tensordiff capture's win)
        c["auto_register"] = key
    if not own:
        callbacks.append({"type": NAME, "auto_register": key})
    config["callbacks"] = callbacks
    copy = os.path.abspath(copy or os.path.join(tempfile.mkdtemp(prefix="tensordiff-mindformers-"),
                                                os.path.basename(path)))
    import yaml

    with open(copy, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    new = list(cmd)
    new[at] = copy if cmd[at] == value else f"--config={copy}"
    env = {} if os.environ.get("REGISTER_PATH") else {"REGISTER_PATH": REGISTER_DIR}
    return new, env
