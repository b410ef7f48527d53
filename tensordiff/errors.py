"""Errors a user can act on.

Every error raised to the user is a ``TensordiffError``: the CLI prints its message on one
line and exits with code 2. Messages name the file or object, the problem and the fix.
"""

from __future__ import annotations


class TensordiffError(Exception):
    """A problem with the user's input; ``str(err)`` is the one-line message."""


class CaptureFileError(TensordiffError):
    """A capture file is missing, truncated or not a tensordiff capture."""


class MappingError(TensordiffError):
    """A mapping (rename rules) file is malformed."""


class AlignmentError(TensordiffError):
    """Two captures cannot be lined up (for example, no module in common)."""


class UsageError(TensordiffError):
    """Options that contradict each other or a value out of range."""
