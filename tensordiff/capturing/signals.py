"""A capture that is told to stop (SIGTERM: how torchrun stops every other worker when one rank fails; SIGHUP: a
closed terminal) finishes writing the steps it was handed and closes its file, within a bounded time, then lets the
signal do what it would have done without tensordiff: the program's own handler runs, or the process ends by the
signal with the status it would have had.

A Ctrl-C (SIGINT) is the program's: it gets its KeyboardInterrupt (or its own handler runs) as without tensordiff,
and the capture closes its file on the way out with every step whose ``step()`` returned. Only while the main thread
hands a step to the writer (a frame into the writer process's pipe, the queue) does the interrupt wait until the
handover is whole, so that it never cuts a step in two.

Installed from the main thread only (Python runs signal handlers there), when the capture starts; removed when it
closes, unless the program installed a handler of its own in between (then that one stays).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

#: How long a signal may wait for the file to be finished before it goes on (seconds; TENSORDIFF_SIGNAL_TIMEOUT).
DEFAULT_TIMEOUT = 30.0
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGINT") if hasattr(signal, name))


def _timeout() -> float:
    try:
        value = float(os.environ.get("TENSORDIFF_SIGNAL_TIMEOUT", DEFAULT_TIMEOUT))
    except ValueError:
        return DEFAULT_TIMEOUT
    return value if value >= 0 else DEFAULT_TIMEOUT


class SignalGuard:
    """Runs ``finish(timeout)`` on SIGTERM / SIGHUP, then the signal's previous disposition; SIGINT's previous
    disposition at once (deferred, as the others are, while the main thread hands a step over)."""

    def __init__(self, finish: Callable[[float], None], busy: Callable[[], bool] | None = None,
                 defer: Callable[[Callable[[], None]], None] | None = None):
        self._finish = finish
        self._busy = busy  # the main thread is inside the writer's queue: the handler waits until it lets go
        self._defer = defer
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal works in the main thread only; the capture goes on without the guard
        for signum in _SIGNALS:
            try:
                previous = signal.getsignal(signum)
                if previous is None:  # installed from C: not ours to chain to
                    continue
                signal.signal(signum, self._handle)
            except (ValueError, OSError, RuntimeError):
                continue
            self._previous[signum] = previous

    def remove(self) -> None:
        for signum, previous in list(self._previous.items()):
            try:
                if signal.getsignal(signum) == self._handle:  # the program's own later handler stays
                    signal.signal(signum, previous)
            except (ValueError, OSError, RuntimeError):
                pass
            del self._previous[signum]

    def _handle(self, signum: int, frame: Any) -> None:
        if self._busy is not None and self._defer is not None and self._busy():
            self._defer(lambda: self._handle(signum, frame))
            return
        previous = self._previous.get(signum, signal.SIG_DFL)
        if signum == getattr(signal, "SIGINT", None):  # the program's: its handler (KeyboardInterrupt) as is
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        self.remove()
        with contextlib.suppress(BaseException):  # the signal's own action happens whatever the capture did
            self._finish(_timeout())
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default: end the process by the signal, as without tensordiff
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
