"""A small reader of TensorBoard event files (TFRecord-framed ``Event`` protobufs): no TensorFlow needed.

Reads the scalars MindFormers, Megatron-LM and tensorboardX write (``simple_value`` and scalar
``TensorProto``s) into a ``Run``, by tag (``TB_TAGS``).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

from ..errors import RunsError
from .run import Run

#: TensorBoard tags -> what they are (the first tags are MindFormers' and Megatron-LM's own).
TB_TAGS = {
    "loss": "loss", "lm loss": "loss", "lm_loss": "loss", "train/loss": "loss", "train_loss": "loss",
    "grad-norm": "grad_norm", "grad_norm": "grad_norm", "global_norm": "grad_norm",
    "learning-rate": "lr", "learning_rate": "lr", "lr": "lr",
    "lm loss validation": "val_loss", "validation loss": "val_loss", "val/loss": "val_loss", "eval_loss": "val_loss",
    "val_loss": "val_loss",
}


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message; length-delimited values as bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: Any
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"wire type {wire}")
        yield number, wire, value


def _tensor_scalar(buf: bytes) -> float | None:
    """A scalar TensorProto (dtype float/double): float_val (5) or double_val (6) or tensor_content (4)."""
    dtype = None
    for number, wire, value in _fields(buf):
        if number == 1 and wire == 0:
            dtype = value
        elif number == 5:
            return struct.unpack("<f", value[:4])[0] if wire == 2 else struct.unpack("<f", value)[0]
        elif number == 6:
            return struct.unpack("<d", value[:8])[0]
        elif number == 4 and len(value) in (4, 8):
            return struct.unpack("<f" if (dtype in (None, 1) and len(value) == 4) else "<d", value)[0]
    return None


def read_tfevents(path: str, data: bytes) -> Run:
    run = Run(path, "tensorboard events")
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        record = data[pos + 12:pos + 12 + length]
        pos += 12 + length + 4
        if len(record) < length:
            raise RunsError(f"{path}: truncated TensorBoard event file (a record of {length} bytes is cut short); "
                            "copy the file again once the run has flushed it")
        step = 0
        values: list[tuple[str, float]] = []
        for number, wire, value in _fields(record):
            if number == 2 and wire == 0:
                step = value
            elif number == 5 and wire == 2:  # Summary
                for n2, w2, val in _fields(value):
                    if n2 != 1 or w2 != 2:
                        continue
                    tag, scalar = "", None
                    for n3, w3, v3 in _fields(val):
                        if n3 == 1 and w3 == 2:
                            tag = v3.decode("utf-8", "replace")
                        elif n3 == 2 and w3 == 5:
                            scalar = struct.unpack("<f", v3)[0]
                        elif n3 == 8 and w3 == 2:
                            scalar = _tensor_scalar(v3)
                    if tag and scalar is not None:
                        values.append((tag, float(scalar)))
        for tag, scalar in values:
            what = TB_TAGS.get(tag.strip().lower())
            if what is not None:
                run.put(what, step, scalar)
    if not run.loss:
        raise RunsError(f"{path}: a TensorBoard event file with no loss scalar (tags read: {', '.join(sorted(TB_TAGS))}); "
                        "pass the training log instead")
    return run
