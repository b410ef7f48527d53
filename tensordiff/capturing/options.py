"""What to capture: options (from arguments and the environment ``tensordiff capture`` sets), file names, file meta."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

from .._version import __version__
from ..errors import UsageError

ENV_OUTPUT = "TENSORDIFF_OUTPUT"
ENV_STEPS = "TENSORDIFF_STEPS"
ENV_TENSORS = "TENSORDIFF_TENSORS"
ENV_DISABLE = "TENSORDIFF_DISABLE"
ENV_STATUS = "TENSORDIFF_STATUS"
ENV_PERTURB = "TENSORDIFF_PERTURB"
ENV_TENSORS_MAX_MB = "TENSORDIFF_TENSORS_MAX_MB"
ENV_TENSORS_MATCH = "TENSORDIFF_TENSORS_MATCH"
ENV_EVERY = "TENSORDIFF_EVERY"
ENV_WRITER = "TENSORDIFF_WRITER"
ENV_DURABLE = "TENSORDIFF_DURABLE"
WRITERS = ("thread", "process")

#: Models of at least this many parameters store full tensors only up to BIG_MODEL_MAX_MB each unless told otherwise.
BIG_MODEL_PARAMS = 1_000_000_000
BIG_MODEL_MAX_MB = 64.0

TENSOR_MODES = ("first", "all", "none")


@dataclass
class CaptureOptions:
    """What to record. Each field doubles as the help text of the matching CLI option."""

    path: str | None = None
    """Output HDF5 file; '{rank}' in the name is replaced by the rank."""
    steps: int = 1
    """Number of training steps to capture; hooks are removed after the last one."""
    every: int = 1
    """Capture every Nth training step (counted by ``step()``): steps 0, N, 2N, ... are recorded, stored under their
    training step number, and ``steps`` of them in all; between them every hook does nothing."""
    tensors: str = "first"
    """Full tensors for: 'first' step only, 'all' steps, or 'none' (statistics only)."""
    inputs: bool = True
    """Record module inputs (tensors already recorded are stored as links, not copies)."""
    grads: bool = True
    """Record gradients of module outputs and inputs during backward."""
    background: bool = True
    """Write on a background thread (off the training thread)."""
    durable: bool = False
    """``step()`` returns once its step is on disk (flushed): a killed run loses no step whose ``step()`` returned."""
    perturb: int | None = None
    """Seed: move every float parameter by one ulp before the first step (only ``tensordiff noise`` sets it)."""
    tensors_max_mb: float | None = None
    """Full tensors only for records up to this many MiB (statistics for larger ones); 0: no limit. Default: no limit,
    64 for models of 1B parameters or more."""
    tensors_match: str | None = None
    """Full tensors only for modules whose name matches this regular expression (statistics for the rest)."""
    writer: str | None = None
    """Where the file is written: 'process' (the default: a child process; HDF5 never holds this process's GIL, and
    a step whose ``step()`` returned survives a SIGKILL) or 'thread' (threads of this process)."""
    _match: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UsageError(f"steps={self.steps}: capture needs at least 1 step")
        if self.every < 1:
            raise UsageError(f"every={self.every}: expected 1 (every step) or more")
        if self.tensors not in TENSOR_MODES:
            raise UsageError(f"tensors={self.tensors!r}: expected one of {', '.join(TENSOR_MODES)}")
        if self.writer not in (None, *WRITERS):
            raise UsageError(f"writer={self.writer!r}: expected one of {', '.join(WRITERS)}")
        if self.tensors_max_mb is not None and not (self.tensors_max_mb >= 0):
            raise UsageError(f"tensors_max_mb={self.tensors_max_mb}: expected a size in MiB, 0 for no limit")
        if self.tensors_match is not None:
            from .._regex import compile_user
            from ..errors import MappingError

            try:  # matched with a time bound: a pattern that backtracks without end stops capture, not training
                self._match = compile_user(self.tensors_match, f"tensors_match={self.tensors_match!r}")
            except MappingError as err:
                raise UsageError(str(err)) from None

    def full_tensor_selected(self, module: str, nbytes: int) -> bool:
        """Whether a record of ``module`` holding ``nbytes`` is stored in full (in a step that stores tensors)."""
        if self.tensors_max_mb and nbytes > self.tensors_max_mb * (1 << 20):
            return False
        return self.tensors_match is None or self._match.search(module) is not None

    def full_tensors_at(self, step: int) -> bool:
        return self.tensors == "all" or (self.tensors == "first" and step == 0)


def options_from_env(path: str | None, steps: int | None, tensors: str | None, **kw: Any) -> CaptureOptions | None:
    """Merge call arguments with the environment set by ``tensordiff capture``.

    The environment wins (the command line asked for it). Returns None when capture
    is off: no path anywhere, or TENSORDIFF_DISABLE=1.
    """
    if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
        return None
    path = os.environ.get(ENV_OUTPUT) or path
    if not path:
        return None
    steps = _env_number(ENV_STEPS, int, "a whole number of steps", steps)
    kw["every"] = _env_number(ENV_EVERY, int, "a whole number of steps", kw.get("every")) or 1
    tensors = os.environ.get(ENV_TENSORS) or tensors or "first"
    kw["tensors_max_mb"] = _env_number(ENV_TENSORS_MAX_MB, float, "a size in MiB", kw.get("tensors_max_mb"))
    kw["perturb"] = _env_number(ENV_PERTURB, int, "a whole-number seed", kw.get("perturb"))
    if os.environ.get(ENV_DURABLE, "") not in ("", "0"):
        kw["durable"] = True
    for env, key in ((ENV_WRITER, "writer"), (ENV_TENSORS_MATCH, "tensors_match")):
        if os.environ.get(env):
            kw[key] = os.environ[env]
    return CaptureOptions(path=path, steps=steps or 1, tensors=tensors, **kw)


def _env_number(name: str, convert: Any, expected: str, default: Any) -> Any:
    """The environment's value of ``name`` converted (a usage error naming it when it does not convert), else
    ``default``."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        return convert(text)
    except ValueError:
        raise UsageError(f"{name}={text!r}: expected {expected}") from None


def report_status(message: str) -> None:
    """Tell ``tensordiff capture`` (through the file it named) why capture did not happen; never raises."""
    target = os.environ.get(ENV_STATUS)
    if not target:
        return
    try:
        with open(target, "a", encoding="utf-8") as f:
            f.write(message.replace("\n", " ") + "\n")
    except OSError:
        pass


def rank_path(path: str, rank: int, world_size: int) -> str:
    """One file per rank: fill '{rank}' or add '.rankN' before the suffix when world_size > 1."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if world_size <= 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.h5'}"


def rank_files(path: str) -> list[str]:
    """The per-rank files ``rank_path`` makes for ``path`` that exist, in rank order."""
    import glob
    import re

    if "{rank}" in path:
        pattern, regex = path.replace("{rank}", "*"), re.escape(path).replace(re.escape("{rank}"), r"(\d+)")
    else:
        root, ext = os.path.splitext(path)
        pattern = f"{root}.rank*{ext or '.h5'}"
        regex = re.escape(root) + r"\.rank(\d+)" + re.escape(ext or ".h5")
    found = [(int(m.group(1)), f) for f in glob.glob(pattern) for m in [re.fullmatch(regex, f)] if m]
    return [f for _, f in sorted(found)]


def base_attrs(framework: str, framework_version: str, options: CaptureOptions, **extra: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "framework": framework,
        "framework_version": framework_version,
        "tensordiff_version": __version__,
        "python_version": platform.python_version(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "argv": " ".join(sys.argv),
        "steps_requested": options.steps,
        "tensors": options.tensors,
    }
    if options.tensors_max_mb:
        attrs["tensors_max_mb"] = options.tensors_max_mb
    if options.tensors_match is not None:
        attrs["tensors_match"] = options.tensors_match
    for pkg, mod in (("megatron_core_version", "megatron.core"), ("transformers_version", "transformers"),
                     ("mindformers_version", "mindformers")):
        module = sys.modules.get(mod)
        version = getattr(module, "__version__", None) if module else None
        if version:
            attrs[pkg] = str(version)
    attrs.update({k: v for k, v in extra.items() if v is not None})
    return attrs
