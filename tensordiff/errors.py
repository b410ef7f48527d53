"""Errors a user can act on: one hierarchy, one class per kind of input.

Every error raised to the user is a ``TensordiffError``: the CLI prints its message on one
line and exits with code 2. Messages name the file or object, the problem and the fix.
``UsageError`` is for flags and arguments; each ``*Error`` below it names the file kind at fault.
"""

from __future__ import annotations


class TensordiffError(Exception):
    """A problem with the user's input; ``str(err)`` is the one-line message."""


class UsageError(TensordiffError):
    """Options that contradict each other or a value out of range."""


class CaptureFileError(TensordiffError):
    """A capture file is missing, truncated or not a tensordiff capture."""


class MappingError(TensordiffError):
    """A mapping file (rename rules or a checkpoint table) is malformed."""


class AlignmentError(TensordiffError):
    """Two captures cannot be lined up (for example, no module in common)."""


class NoiseFileError(TensordiffError):
    """A noise file is missing or malformed."""


class CheckpointError(TensordiffError):
    """A checkpoint is missing or unreadable, or does not fit its mapping table (all problems in one message)."""


class BatchError(TensordiffError):
    """A batch file is missing, malformed, or does not fit the model."""


class RunsError(TensordiffError):
    """A run file (training log, TensorBoard events, capture) is missing or in no format tensordiff reads."""


class ReplayError(TensordiffError):
    """A module cannot be replayed (not captured, not importable, not in the model, inputs missing)."""


class ConfigError(TensordiffError):
    """A configuration (Megatron-LM log or flags, MindFormers YAML, config.json, checkpoint, capture) is missing or
    in no format tensordiff reads."""
