"""The one way tensordiff warns from inside a training run: one line on stderr, never an exception.

A warning goes through Python's ``warnings`` machinery (so ``-W ignore::tensordiff._warn.TensordiffWarning`` or a
``warnings.filterwarnings`` silences it, and tests can catch it) but as one line: it is issued for the file name
``tensordiff`` at line 0, which has no source line for Python to print under it. Where warnings are turned into
errors (``-W error``), the line is printed instead: a warning of the capture never stops the run it observes.
"""

from __future__ import annotations

import contextlib
import sys
import warnings


class TensordiffWarning(RuntimeWarning):
    """A problem of the capture or its writer; the training run goes on."""


def warn(message: str) -> None:
    try:
        warnings.warn_explicit(message, TensordiffWarning, "tensordiff", 0, module="tensordiff")
    except Warning:  # -W error: the training run comes first (and a closed stderr must not stop it either)
        with contextlib.suppress(Exception):
            sys.stderr.write(f"{message}\n")
