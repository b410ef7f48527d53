"""The last defence against a damaged HDF5 file: on some damaged files (a heap address bent by a flipped bit) HDF5
loops without end inside one call, holding Python's lock, where no signal handler or thread can run.

The ``tensordiff`` command therefore runs as two processes (``supervise``): the parent only waits; the child does
the work, and each read of a capture or batch file runs in a ``section`` that posts its deadline to memory both
share. A section still open ``TENSORDIFF_READ_TIMEOUT`` seconds (default 300) after it began makes the parent end
the child and print one line naming the file, with exit code 2. ``TENSORDIFF_READ_TIMEOUT=0`` turns this off.

Programs that read captures through the API are not supervised (``section`` then costs one attribute lookup)."""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import struct
import threading
import time
from collections.abc import Iterator

ENV = "TENSORDIFF_READ_TIMEOUT"
DEFAULT_SECONDS = 300.0
_HEAD = struct.Struct("d")  # the earliest open deadline (time.time()), 0 when no section is open
_SIZE = 4096

_lock = threading.Lock()
_sections: dict[int, tuple[float, str]] = {}
_state: dict = {"shared": None, "seconds": 0.0, "next": 0}


def bound() -> float:
    """The seconds one read may take (0: no supervision)."""
    try:
        return max(0.0, float(os.environ.get(ENV, "") or DEFAULT_SECONDS))
    except ValueError:
        return DEFAULT_SECONDS


def supervise() -> int | None:
    """Fork. In the child (which does the work) return None; in the parent wait for the child and return its exit
    code, or 2 after ending a child stuck in one read past the bound."""
    seconds = bound()
    if not seconds or not hasattr(os, "fork"):
        return None
    shared = mmap.mmap(-1, _SIZE)
    pid = os.fork()
    if pid == 0:
        _state.update(shared=shared, seconds=seconds)
        _die_with_parent()
        return None
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}  # Ctrl-C reaches the child itself
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a kill of the command reaches the process doing the work
        previous[sig] = signal.signal(sig, lambda number, _frame: os.kill(pid, number))
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                return code if code >= 0 else 128 - code
            deadline = _HEAD.unpack_from(shared, 0)[0]
            if deadline and time.time() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                what = shared[_HEAD.size:].split(b"\0", 1)[0].decode("utf-8", "replace")
                os.write(2, (f"tensordiff: error: {what} did not return in {seconds:g} s (HDF5 loops on some damaged "
                             f"files); write the file again (or raise {ENV} for a very slow disk)\n").encode())
                return 2
            time.sleep(0.02)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _die_with_parent() -> None:
    """Linux: the child is killed when the parent is (a SIGKILL of the command leaves no orphan reading on)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(2)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def section(path: str, what: str) -> Iterator[None]:
    """One read of ``path`` (``what``: the part read), watched when the process is supervised."""
    if _state["shared"] is None:
        yield
        return
    with _lock:
        key = _state["next"] = _state["next"] + 1
        _sections[key] = (time.time() + _state["seconds"], f"{path}: damaged: reading {what}")
        _post()
    try:
        yield
    finally:
        with _lock:
            _sections.pop(key, None)
            _post()


def _post() -> None:
    shared = _state["shared"]
    if not _sections:
        _HEAD.pack_into(shared, 0, 0.0)
        return
    deadline, text = min(_sections.values())
    data = text.encode("utf-8", "replace")[:_SIZE - _HEAD.size - 1] + b"\0"
    shared[_HEAD.size:_HEAD.size + len(data)] = data
    _HEAD.pack_into(shared, 0, deadline)
