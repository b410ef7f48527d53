"""One batch file for both frameworks: token ids, labels, masks, positions, and how they were made.

Write it once (``tensordiff batch -o batch.h5 --vocab 128 --seq 16 --batch 2``), then load
it on each side with one call::

    b = tensordiff.batch.load("batch.h5", vocab_size=128, framework="torch")      # torch tensors
    b = tensordiff.batch.load("batch.h5", vocab_size=128, framework="mindspore")  # MindSpore tensors

Fields (``[B, S]`` unless noted):

* ``tokens``: input ids; ``labels``: the next token of each position;
* ``loss_mask``: float32, 1 where the token counts in the loss;
* ``attention_mask``: bool ``[B, 1, S, S]``, True = masked out (Megatron's convention;
  MindFormers uses the same 1 = masked);
* ``position_ids``: 0..S-1 per row.

The ids come from a seeded generator or from a text file tokenised as UTF-8 bytes; the
seed, the source and its SHA-256 are stored as attributes. Nothing is pickled.

Or they come from a captured run (``from_calls``; ``tensordiff batch --from-capture run.h5``): the token ids,
labels and loss mask its model was called with, step after step, read back from the capture's records of the
model's inputs (stored in full with ``--tensors all``). A run that draws its own data (Megatron-LM's
``--mock-data``, its indexed datasets) hands the other framework the very batches it trained on.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from . import _watchdog as watchdog
from . import frameworks
from ._text import first_line
from .errors import BatchError

FORMAT = 1
FIELDS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


@dataclass
class Batch:
    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    attention_mask: np.ndarray
    position_ids: np.ndarray
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_length(self) -> int:
        return int(self.tokens.shape[1])

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in FIELDS}

    def stream(self) -> np.ndarray:
        """``[B, S+1]``: tokens with the last label appended (models that shift labels themselves, e.g. legacy Llama)."""
        return np.concatenate([self.tokens, self.labels[:, -1:]], axis=1)


def make(vocab_size: int, seq_length: int, batch_size: int, seed: int = 0, text: str | None = None,
         low: int = 1) -> Batch:
    """A next-token batch: random ids in ``[low, vocab_size)`` (id 0 is often padding), or
    ``batch_size`` windows of ``seq_length + 1`` UTF-8 bytes of ``text`` chosen with ``seed``."""
    if vocab_size < 2 or seq_length < 1 or batch_size < 1:
        raise BatchError(f"vocab {vocab_size}, seq {seq_length}, batch {batch_size}: each must be positive "
                         "(vocab at least 2)")
    rng = np.random.default_rng(seed)
    attrs: dict[str, Any] = {"seed": seed, "vocab_size": vocab_size}
    if text is None:
        if low >= vocab_size:
            raise BatchError(f"--low {low} leaves no ids below vocab {vocab_size}")
        stream = rng.integers(low, vocab_size, size=(batch_size, seq_length + 1), dtype=np.int64)
        attrs.update(source="random", low=low)
    else:
        if not os.path.isfile(text):
            raise BatchError(f"{text}: no such text file; pass an existing file to --text")
        with open(text, "rb") as f:
            data = f.read()
        if vocab_size < 256:
            raise BatchError(f"{text}: UTF-8 byte tokens need a vocabulary of at least 256, got --vocab {vocab_size}; "
                             "pass --vocab 256 (or larger) or leave out --text for random ids")
        if len(data) < seq_length + 1:
            raise BatchError(f"{text}: {len(data)} bytes, fewer than one window of {seq_length + 1}")
        starts = rng.integers(0, len(data) - seq_length, size=batch_size)
        stream = np.stack([np.frombuffer(data[s:s + seq_length + 1], dtype=np.uint8) for s in starts]).astype(np.int64)
        attrs.update(source=f"text:{os.path.basename(text)}", tokenizer="utf-8 bytes",
                     sha256=hashlib.sha256(data).hexdigest(), offsets=",".join(str(int(s)) for s in starts))
    tokens, labels = stream[:, :-1].copy(), stream[:, 1:].copy()
    mask = np.triu(np.ones((seq_length, seq_length), dtype=bool), 1)
    return Batch(
        tokens=tokens,
        labels=labels,
        loss_mask=np.ones((batch_size, seq_length), dtype=np.float32),
        attention_mask=np.broadcast_to(mask, (batch_size, 1, seq_length, seq_length)).copy(),
        position_ids=np.broadcast_to(np.arange(seq_length, dtype=np.int64), (batch_size, seq_length)).copy(),
        attrs=attrs,
    )


#: the model's input slots ``from_calls`` reads: megatron-core's GPTModel is called as
#: ``model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)``; HF-style models name them
TOKEN_SLOTS = ("0", "input_ids")
POSITION_SLOTS = ("1", "position_ids")


@dataclass
class ModelCall:
    """One call of a captured model (a micro-batch): its tensor inputs by slot (``"0"``, ``"labels"``, ...), each
    array or None where the capture kept statistics only; ``where`` names it in messages."""

    where: str
    inputs: dict[str, np.ndarray | None]


def from_calls(calls: list[ModelCall], attrs: dict[str, Any] | None = None, vocab_size: int | None = None) -> Batch:
    """The rows a captured run's model was called with, the calls in order (``tensordiff batch --from-capture``
    reads them out of a capture: every complete step, every call of the model in a step). Each call must pass token
    ids ``[B, S]`` (first argument or ``input_ids``) and ``labels=`` (the next tokens: ``labels[:, :-1] ==
    tokens[:, 1:]``), stored in full (capture with ``--tensors all``); ``loss_mask=`` and integer position ids (second
    argument or ``position_ids``) are taken when recorded, else all ones and ``0..S-1``. The attention mask is the
    causal one of ``make``."""
    if not calls:
        raise BatchError("no call of the model to take rows from")
    tokens: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    for call in calls:
        slots, where = call.inputs, call.where
        tok_slot = next((s for s in TOKEN_SLOTS if s in slots), None)
        if tok_slot is None or "labels" not in slots:
            raise BatchError(f"{where}: the model was called without token ids and labels (inputs: "
                             f"{', '.join(sorted(slots))}); --from-capture reads a call like megatron-core's "
                             "model(tokens, position_ids, attention_mask, labels=labels)")
        t, lb = slots[tok_slot], slots["labels"]
        if t is None or lb is None:
            raise BatchError(f"{where}: the model's inputs are stored as statistics only; capture again with "
                             "--tensors all (full tensors of every step)")
        if t.ndim != 2 or t.dtype.kind not in "iu" or lb.shape != t.shape or lb.dtype.kind not in "iu":
            raise BatchError(f"{where}: token ids {t.dtype} {t.shape} and labels {lb.dtype} {lb.shape}: expected "
                             "integer tables [batch, seq] of one shape")
        if tokens and t.shape[1] != tokens[0].shape[1]:
            raise BatchError(f"{where}: sequence length {t.shape[1]}, earlier calls {tokens[0].shape[1]}; one "
                             "batch file holds one sequence length")
        if not np.array_equal(t[:, 1:], lb[:, :-1]):
            raise BatchError(f"{where}: the labels are not the token ids shifted by one (labels[:, :-1] != "
                             "tokens[:, 1:]), so the rows cannot be written as [S+1] streams")
        m = slots.get("loss_mask")
        masks.append(np.ones(t.shape, np.float32) if m is None or m.shape != t.shape else m.astype(np.float32))
        p = next((slots[s] for s in POSITION_SLOTS if s in slots), None)
        if p is None or p.dtype.kind not in "iu" or p.shape not in ((t.shape[1],), (1, t.shape[1]), t.shape):
            p = np.arange(t.shape[1], dtype=np.int64)
        tokens.append(t.astype(np.int64))
        labels.append(lb.astype(np.int64))
        positions.append(np.broadcast_to(p.astype(np.int64), t.shape))
    tok_all, lab_all = np.concatenate(tokens), np.concatenate(labels)
    low, top = int(min(tok_all.min(), lab_all.min())), int(max(tok_all.max(), lab_all.max()))
    if low < 0 or (vocab_size is not None and top >= vocab_size):
        raise BatchError(f"{calls[0].where.split(':')[0]}: token id {low if low < 0 else top} does not fit "
                         + (f"the model's vocabulary of {vocab_size}" if vocab_size is not None else "a vocabulary")
                         + " (ids must be 0..V-1)")
    b, s = tok_all.shape
    causal = np.triu(np.ones((s, s), dtype=bool), 1)
    out_attrs: dict[str, Any] = dict(attrs or {}, calls=len(calls))
    if vocab_size is not None:
        out_attrs["vocab_size"] = vocab_size
    return Batch(tokens=tok_all, labels=lab_all, loss_mask=np.concatenate(masks),
                 attention_mask=np.broadcast_to(causal, (b, 1, s, s)).copy(),
                 position_ids=np.concatenate(positions), attrs=out_attrs)


def save(path: str, batch: Batch) -> None:
    with h5py.File(path, "w") as f:
        f.attrs["tensordiff_batch"] = FORMAT
        f.attrs["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        for key, value in batch.attrs.items():
            f.attrs[key] = value
        for name, array in batch.arrays().items():
            f.create_dataset(name, data=array)


def save_mindrecord(path: str, batch: Batch) -> None:
    """The batch's rows as MindFormers' Trainer reads them: a MindRecord file whose ``input_ids`` column holds each
    row's ``[S+1]`` stream (the model shifts the labels itself)."""
    try:
        ms = frameworks.get("mindspore")
    except ImportError:
        raise BatchError(f"{path}: a MindRecord file needs MindSpore, which is not installed here; pip install "
                         "mindspore, or leave out --mindrecord") from None
    ms.write_mindrecord(path, {"input_ids": batch.stream()}, shown_as=path)


def read(path: str, vocab_size: int | None = None) -> Batch:
    """Read and check a batch file; ``vocab_size`` (the model's) must hold every id."""
    if not os.path.exists(path):
        raise BatchError(f"{path}: no such batch file; write one with: tensordiff batch -o {path} --vocab V --seq S --batch B")
    try:
        with watchdog.section(path, "the batch file"):
            f = h5py.File(path, "r")
    except OSError:
        raise BatchError(f"{path}: not an HDF5 file (truncated or another format); write it again with tensordiff "
                         "batch") from None
    try:
        with f, watchdog.section(path, "the batch file"):
            return _read(f, path, vocab_size)
    except (OSError, RuntimeError, KeyError, ValueError, TypeError, MemoryError) as err:  # HDF5 on a damaged file
        raise BatchError(f"{path}: damaged ({first_line(err, 160, default=type(err).__name__)}); write it again with "
                         "tensordiff batch") from None


def _read(f: h5py.File, path: str, vocab_size: int | None) -> Batch:
    if "tensordiff_batch" not in f.attrs:
        raise BatchError(f"{path}: not a tensordiff batch file (no 'tensordiff_batch' attribute); "
                         "write one with tensordiff batch")
    if int(f.attrs["tensordiff_batch"]) > FORMAT:
        raise BatchError(f"{path}: batch format {int(f.attrs['tensordiff_batch'])} is newer than this tensordiff "
                         f"reads ({FORMAT}); upgrade tensordiff")
    missing = [name for name in FIELDS if name not in f]
    if missing:
        raise BatchError(f"{path}: missing field(s) {', '.join(missing)}; write it again with tensordiff batch")
    arrays = {name: f[name][()] for name in FIELDS}
    for name, array in arrays.items():
        if not isinstance(array, np.ndarray) or array.ndim != (4 if name == "attention_mask" else 2) or \
                array.dtype.kind not in "biuf":
            raise BatchError(f"{path}: {name} is not a table of numbers ({getattr(array, 'dtype', type(array))}, "
                             f"shape {getattr(array, 'shape', ())}); write it again with tensordiff batch")
    for name in ("tokens", "labels", "position_ids"):
        if arrays[name].dtype.kind not in "iu":
            raise BatchError(f"{path}: {name} holds {arrays[name].dtype}, expected integer ids; write it again with "
                             "tensordiff batch")
    attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
    b, s = arrays["tokens"].shape
    for name in ("labels", "loss_mask", "position_ids"):
        if arrays[name].shape != (b, s):
            raise BatchError(f"{path}: {name} has shape {arrays[name].shape}, tokens {(b, s)}; the file is inconsistent")
    if vocab_size is not None:
        top = int(max(arrays["tokens"].max(), arrays["labels"].max()))
        low = int(min(arrays["tokens"].min(), arrays["labels"].min()))
        if top >= vocab_size or low < 0:
            made_for = attrs.get("vocab_size", "?")
            raise BatchError(f"{path}: token id {top if top >= vocab_size else low} does not fit the model's vocabulary of "
                             f"{vocab_size} (the batch was written for vocab {made_for}); write it again with "
                             f"tensordiff batch --vocab {vocab_size}")
    return Batch(attrs=attrs, **arrays)


def load(path: str, vocab_size: int | None = None, framework: str = "numpy") -> dict[str, Any]:
    """The batch as a dict of ``framework`` tensors ('numpy', 'torch' or 'mindspore').

    Integer ids are int64 for numpy/torch and int32 for MindSpore (what its embedding
    takes); ``stream`` is ``[B, S+1]`` for models that shift labels themselves.
    """
    batch = read(path, vocab_size)
    arrays = batch.arrays()
    arrays["stream"] = batch.stream()
    if framework == "numpy":
        return arrays
    if framework not in frameworks.NAMES:
        raise BatchError(f"framework {framework!r}: expected numpy, torch or mindspore")
    if framework == "mindspore":  # MindSpore's embedding takes int32 ids
        arrays = {k: v.astype(np.int32) if v.dtype == np.int64 else v for k, v in arrays.items()}
    from_numpy = frameworks.get(framework).from_numpy
    return {k: from_numpy(v) for k, v in arrays.items()}
