"""How ``tensordiff capture`` runs a program that does not call tensordiff: the user's command rewritten for its
launcher, and what the program's environment gets besides the capture's own settings.

``LAUNCHERS`` holds one ``Launcher`` per option of ``tensordiff capture`` (a new launcher is one more entry):

* ``--auto``: any PyTorch script, ``python [OPTIONS] SCRIPT ARGS`` or ``python [OPTIONS] -m MODULE ARGS``, run through
  the entry point ``auto_main`` (``python [OPTIONS] -m tensordiff.capturing.auto_main SCRIPT ARGS``);
* ``--megatron``: a megatron-core program (Megatron-LM's ``pretrain_gpt.py``): ``torchrun [OPTIONS] SCRIPT ARGS`` (or
  ``python -m torch.distributed.run ...``) with every worker run through ``megatron_main`` (``torchrun [OPTIONS] -m
  tensordiff.capturing.megatron_main SCRIPT ARGS``), or ``python SCRIPT ARGS`` as for ``--auto``;
* ``--mindformers``: a MindFormers Trainer command, ``python run_mindformer.py --config x.yaml ARGS`` (or ``msrun
  [OPTIONS] run_mindformer.py ...``, anything whose arguments hold ``--config FILE``), run on a copy of the YAML with
  the ``TensordiffCapture`` callback appended to its ``callbacks`` (written next to the capture, as
  ``FILE.mindformers.yaml``: the user's file is never written). The callback is registered through MindFormers' own
  ``auto_register`` key: ``REGISTER_DIR--tensordiff_capture.TensordiffCapture`` (the folder named in the key, so a
  ``--register_path`` of the user's own stays as it is); ``REGISTER_PATH`` is set only where nothing sets it
  (MindFormers refuses ``auto_register`` without one).

``quiet_startup``: the ``startup`` folder first on the program's PYTHONPATH, so that the frameworks' start-up chatter
is left out (``--framework-logs`` keeps it). Framework-free: a command is read and rewritten, never imported.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._yaml import load_yaml
from ..errors import MappingError, UsageError
from .mindformers_register import NAME, REGISTER_DIR, REGISTER_MODULE
from .startup import ENV_FRAMEWORK_LOGS
from .startup import FOLDER as STARTUP_FOLDER

__all__ = ["AUTO_MODULE", "LAUNCHERS", "MEGATRON_MODULE", "Launcher", "auto_command", "launch_command",
           "megatron_command", "mindformers_command", "near_misses", "quiet_startup"]

#: The entry point ``tensordiff capture --auto`` runs a PyTorch program through (``capturing/auto_main.py``).
AUTO_MODULE = "tensordiff.capturing.auto_main"
#: The entry point every worker of ``tensordiff capture --megatron`` runs through (``capturing/megatron_main.py``).
MEGATRON_MODULE = "tensordiff.capturing.megatron_main"


#: A python program's name (python, python3, python3.11, python.exe)
PYTHON = re.compile(r"python[0-9.]*(\.exe)?")


#: torchrun's options that take no value (torch.distributed.run); every other option takes one
_TORCHRUN_FLAGS = {"--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path",
                   "--virtual-local-rank", "--virtual_local_rank"}
_TORCH_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")


def megatron_command(cmd: list[str]) -> list[str]:
    """``torchrun [OPTIONS] SCRIPT ARGS`` (or ``python -m torch.distributed.run ...``) with every worker run through
    the packaged entry point (``torchrun [OPTIONS] -m tensordiff.capturing.megatron_main SCRIPT ARGS``), or
    ``python SCRIPT ARGS`` as ``auto_command`` does; anything else is a UsageError."""
    launcher = 1 if cmd and os.path.basename(cmd[0]) == "torchrun" else 0
    if not launcher and len(cmd) > 2 and PYTHON.fullmatch(os.path.basename(cmd[0])) and cmd[1] == "-m" \
            and cmd[2] in _TORCH_LAUNCHERS:
        launcher = 3
    if not launcher:
        return auto_command(cmd, MEGATRON_MODULE, "--megatron", launchers=True)
    i = launcher
    module = False
    while i < len(cmd) and cmd[i].startswith("-") and cmd[i] != "--":
        flag = cmd[i].split("=", 1)[0]
        if flag in ("--no-python", "--no_python"):
            raise UsageError("--megatron: torchrun --no-python runs a program that is not Python; run the Python "
                             "training script under torchrun (`torchrun [OPTIONS] pretrain_gpt.py ARGS`)")
        module = module or flag in ("-m", "--module")
        i += 1 if "=" in cmd[i] or flag in _TORCHRUN_FLAGS else 2
    if cmd[i:i + 1] == ["--"]:
        i += 1
    if i >= len(cmd):
        raise UsageError(f"--megatron: `{shlex.join(cmd)}` names no training script; write the command as "
                         "`torchrun --nproc-per-node N pretrain_gpt.py ARGS`")
    options = [a for a in cmd[launcher:i] if a.split("=", 1)[0] not in ("-m", "--module")]
    script = ["-m", cmd[i]] if module else [cmd[i]]
    return [*cmd[:launcher], *options, "-m", MEGATRON_MODULE, *script, *cmd[i + 1:]]


def auto_command(cmd: list[str], module: str = AUTO_MODULE, flag: str = "--auto",
                 launchers: bool = False) -> list[str]:
    """``python [OPTIONS] SCRIPT ARGS`` or ``python [OPTIONS] -m MODULE ARGS``, run through the packaged entry point
    (``python [OPTIONS] -m tensordiff.capturing.auto_main SCRIPT ARGS``); anything else is a UsageError."""
    if not cmd or not PYTHON.fullmatch(os.path.basename(cmd[0])):
        also = " or `torchrun [OPTIONS] train.py ARGS`" if launchers else ""
        raise UsageError(f"{flag}: {shlex.join(cmd[:1]) or 'nothing'} is not a python command; write the command as "
                         f"`python train.py ARGS` or `python -m package.module ARGS`{also}")
    i = 1
    while i < len(cmd):
        arg = cmd[i]
        if arg == "-" or not arg.startswith("-"):
            break
        if arg.startswith("--"):
            if arg != "--check-hash-based-pycs":
                raise UsageError(f"{flag}: `{shlex.join(cmd[:i + 1])}` runs no script; write the command as "
                                 "`python train.py ARGS` or `python -m package.module ARGS`")
            i += 2
            continue
        for j, short in enumerate(arg[1:], 2):  # short options, possibly combined (-u, -uB, -Wignore, -mpkg.mod)
            if short not in "mcWX":
                continue
            value, used = (arg[j:], 1) if arg[j:] else (cmd[i + 1] if i + 1 < len(cmd) else "", 2)
            if short == "c":
                raise UsageError(f"{flag}: `python -c CODE` has no script to run through the capture; save the code in a "
                                 "file and run `python FILE`")
            if short == "m":
                if not value:
                    raise UsageError(f"{flag}: `python -m` names no module; write `python -m package.module ARGS`")
                if value in _TORCH_LAUNCHERS:  # the launcher's process has no model: the workers it starts do
                    raise UsageError(f"{flag}: `python -m {value}` starts worker processes that {flag} would not "
                                     "capture; for a megatron-core program use `tensordiff capture --megatron -- "
                                     f"python -m {value} ... train.py ARGS`, else capture one worker: "
                                     "`python train.py ARGS`")
                options = cmd[1:i] + ([arg[:j - 1]] if j > 2 else [])
                return [cmd[0], *options, "-m", module, "-m", value, *cmd[i + used:]]
            i += used - 1
            break
        i += 1
    if i >= len(cmd) or cmd[i] == "-":
        raise UsageError(f"{flag}: `{shlex.join(cmd)}` names no script; write the command as `python train.py ARGS` or "
                         "`python -m package.module ARGS`")
    return [cmd[0], *cmd[1:i], "-m", module, *cmd[i:]]


def check_importable(python: str, module: str = AUTO_MODULE, flag: str = "--auto") -> None:
    """The program's python must import tensordiff (it runs the entry point): one line if it cannot."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        code = subprocess.call([python, "-c", probe], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        raise UsageError(f"cannot run {python!r}: no such program; check the command after '--'") from None
    except OSError as err:
        raise UsageError(f"cannot run {python!r}: {err.strerror}; check the command after '--'") from None
    if code != 0:
        raise UsageError(f"{flag}: {python} cannot import {module}; install this tensordiff into that python's "
                         f"environment, or start the command with {sys.executable}")


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
    folder), and the environment to add. A UsageError when the command has no ``--config``, the file is missing or is
    not YAML, or its ``callbacks`` name a near-miss of ``TensordiffCapture``.
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


@dataclass(frozen=True)
class Launcher:
    """One way ``tensordiff capture`` runs a program that does not call tensordiff: its option ``--NAME``."""

    name: str
    #: (the user's command, the capture file's absolute path) -> (the command to run, environment to add); a
    #: UsageError for a command it cannot run
    rewrite: Callable[[list[str], str], tuple[list[str], dict[str, str]]]
    #: ``tensordiff capture --help``'s line for the option
    help: str
    #: the entry point the program's python must import (checked before the run where the command starts with python)
    entry: str | None = None


LAUNCHERS: dict[str, Launcher] = {launcher.name: launcher for launcher in (
    Launcher("auto", lambda cmd, output: (auto_command(cmd), {}), entry=AUTO_MODULE,
             help="PyTorch script that does not call tensordiff: run `python SCRIPT ...` / `python -m MODULE ...` "
                  "through tensordiff's entry point; training steps only (evaluation is skipped)"),
    Launcher("megatron", lambda cmd, output: (megatron_command(cmd), {}), entry=MEGATRON_MODULE,
             help="a megatron-core training program that does not call tensordiff (Megatron-LM's pretrain_gpt.py, or "
                  "any loop on megatron-core's schedule and optimizer): `torchrun [OPTIONS] SCRIPT ...` or `python "
                  "SCRIPT ...`, every rank captured (docs/megatron-lm.md)"),
    Launcher("mindformers", lambda cmd, output: mindformers_command(cmd, output + ".mindformers.yaml"),
             help="a MindFormers Trainer command with --config x.yaml (run_mindformer.py, under python or msrun): run "
                  "on a copy of the YAML with the TensordiffCapture callback added (docs/mindformers-trainer.md)"),
)}


def launch_command(name: str, cmd: list[str], output: str) -> tuple[list[str], dict[str, str]]:
    """``cmd`` rewritten for the launcher ``name`` (``output``: the capture file's absolute path), and the environment
    to add; a UsageError for a command it cannot run, or where the program's python cannot import the entry point."""
    launcher = LAUNCHERS[name]
    cmd, env = launcher.rewrite(cmd, output)
    if launcher.entry is not None and PYTHON.fullmatch(os.path.basename(cmd[0])):
        check_importable(cmd[0], launcher.entry, f"--{name}")
    return cmd, env


def quiet_startup(env: dict[str, str], keep: bool = False) -> None:
    """The frameworks' start-up chatter left out of the program run with ``env`` (the ``startup`` folder first on its
    PYTHONPATH, Megatron-LM's logging at WARNING), unless ``keep`` (``--framework-logs``) or TENSORDIFF_FRAMEWORK_LOGS
    is set."""
    if keep or os.environ.get(ENV_FRAMEWORK_LOGS):
        return
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [STARTUP_FOLDER, env.get("PYTHONPATH")]))
    env.setdefault("MEGATRON_LOGGING_LEVEL", "30")  # Megatron-LM's root logger at WARNING (its default: INFO)
