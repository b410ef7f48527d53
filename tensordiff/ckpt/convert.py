"""``convert_file(src, dst, mapping)``: read a checkpoint, convert it with a table, write it; what was done."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import CheckpointError, UsageError
from .files import format_of, load_with_skipped, save
from .plan import Conversion
from .table import ConversionTable


@dataclass
class ConvertedFile:
    """One conversion done (``report.ckpt.ConvertSummary`` renders it)."""

    src: str
    dst: str
    conversion: Conversion
    mapping: str
    """The table, described (name and variables)."""
    why: str
    """How the direction was chosen."""
    read: int
    """Tensors read from ``src``."""
    size: int
    """Bytes written."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Non-tensor entries of ``src`` left out: name -> type."""


def convert_file(src: str, dst: str, mapping: str, variables: dict[str, str] | None = None,
                 to: str | None = None) -> ConvertedFile:
    """Convert checkpoint ``src`` to the other side of table ``mapping`` (or to side ``to``) and write ``dst``.

    Every key and shape is checked first; all problems are raised at once as one ``CheckpointError``."""
    format_of(dst)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise UsageError(f"{dst}: DST is SRC; write the converted checkpoint to another file")
    table = ConversionTable.load(mapping, variables)
    tensors, skipped = load_with_skipped(src)
    if to is not None:
        if to not in table.sides:
            raise UsageError(f"--to {to}: {table.name} converts between {' and '.join(table.sides)}")
        source, why = table.other(to), "--to"
    else:
        found, why = table.detect_side(tensors, src, dst)
        if found is None:
            raise CheckpointError(f"{src}: cannot tell whether it is {table.sides[0]} or {table.sides[1]} ({why}); "
                                  f"pass --to {table.sides[1]} or --to {table.sides[0]}")
        source = found
    conv = table.convert(tensors, source=source, path=src)
    size = save(conv.tensors, dst)
    return ConvertedFile(src, dst, conv, table.describe(), why, len(tensors), size, skipped)
