"""Megatron-LM's parameter-gradient files read as a capture: ``MegatronGradDump(path)`` is a capture reader
(``CaptureReader``, nothing is copied), so that ``tensordiff diff`` compares them with a capture of the same run,
or two runs' files with each other.

Megatron-LM (``pretrain_gpt.py``, ``megatron/training``) writes, with ``--save DIR --save-wgrads-interval N``, every
Nth iteration, each parameter's reduced gradient (``main_grad``, after the data-parallel all-reduce, before the
optimizer step) to ``DIR/wgrads/iter_NNNNNNN/mp_rank_TT[_PPP][_EEE].pth``, a ``torch.save`` of
``{"model_chunk0": {parameter name: tensor}}``.

Read as: phase ``param_grad``, kind ``grad``, module and slot from the name (``decoder.layers.0.mlp.linear_fc1.weight``
-> module ``decoder.layers.0.mlp.linear_fc1``, slot ``weight``). Iteration ``N`` (Megatron-LM counts from 1) is step
``N - 1``, as a capture of the run from its start numbers it; ``step_attrs(step)["iteration"]`` gives ``N``.
Statistics are computed from the tensors when read.

What the files do not hold is declared, not guessed: ``attrs["not_recorded_phases"]`` names the phases (weights,
forward, loss, backward), so a diff against a full capture counts A's records of those phases as not recorded by B
and says so, and judges the rest. One model chunk, TP = PP = EP = 1 (``mp_rank_00.pth``); other layouts are one line
naming what is missing. ``--save-dgrads-interval``'s files (``DIR/dgrads``: gradients at the linear layers only) are
not read: they cover part of the backward, and core_v0.16.1 writes none without Transformer Engine. ``.pth`` files
are read without unpickling (``torch_file.TorchArchive``): a file naming anything but tensors in dicts is refused.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import numpy as np

from .. import dtypes
from ..errors import CaptureFileError
from ..record import Record
from .base import ReaderBase
from .torch_file import TorchArchive

_ITER = re.compile(r"^iter_(\d{7})$")
_KINDS = ("wgrads",)
_FIX = "the file is damaged or was not written by Megatron-LM's --save-wgrads-interval"


def _root(path: str) -> str | None:
    """The ``--save`` folder of a gradient dump given that folder, its ``wgrads`` folder, one iteration's folder or one
    ``.pth`` file; None when ``path`` is none of them."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        path = os.path.dirname(path)
    if _ITER.match(os.path.basename(path)):
        path = os.path.dirname(path)
    if os.path.basename(path) in _KINDS:
        path = os.path.dirname(path)
    if any(os.path.isdir(os.path.join(path, k)) and any(_ITER.match(n) for n in os.listdir(os.path.join(path, k)))
           for k in _KINDS):
        return path
    return None


def is_megatron_grads(path: str) -> bool:
    """Whether ``path`` is (a part of) a Megatron-LM gradient dump: ``wgrads/`` with ``iter_NNNNNNN`` folders."""
    try:
        return _root(path) is not None
    except OSError:
        return False


class MegatronGradDump(ReaderBase):
    """Megatron-LM's ``wgrads`` files read as a capture (see the module docstring)."""

    def __init__(self, path: str):
        super().__init__(path)
        if not os.path.exists(path):
            raise CaptureFileError(f"{path}: no such file or folder; check the path of the Megatron-LM --save folder")
        root = _root(path)
        if root is None:
            raise CaptureFileError(f"{path}: no Megatron-LM gradient files here (no wgrads/ with iter_NNNNNNN "
                                   "folders); pass the --save folder of a run with --save-wgrads-interval")
        only = os.path.basename(os.path.dirname(os.path.abspath(path))) if os.path.isfile(path) else ""
        self._files: dict[tuple[str, int], str] = {}  # (kind, iteration) -> .pth
        for kind in _KINDS:
            folder = os.path.join(root, kind)
            if not os.path.isdir(folder):
                continue
            for name in sorted(os.listdir(folder)):
                m = _ITER.match(name)
                if not m or (only and _ITER.match(only) and name != only):
                    continue
                files = sorted(os.listdir(os.path.join(folder, name)))
                shards = [f for f in files if f.endswith(".pth")]
                if shards != ["mp_rank_00.pth"]:
                    raise CaptureFileError(
                        f"{os.path.join(folder, name)}: holds {', '.join(shards) or 'no .pth file'}; tensordiff reads "
                        "the gradients of one model-parallel rank (TP = PP = EP = 1: mp_rank_00.pth); a sharded "
                        "run's gradient files are not joined")
                self._files[(kind, int(m.group(1)))] = os.path.join(folder, name, "mp_rank_00.pth")
        iterations = sorted({i for _, i in self._files})
        if not iterations:
            raise CaptureFileError(f"{path}: its wgrads folder holds no iter_NNNNNNN/mp_rank_00.pth")
        self.steps = [i - 1 for i in iterations]
        self._archives: dict[str, TorchArchive] = {}
        self._cache: dict[int, list[Record]] = {}
        self._where: dict[tuple[int, int], tuple[str, tuple[str, ...]]] = {}
        self.attrs = {
            "framework": "torch", "tensordiff_format": 1, "source": "megatron-lm wgrads", "tensors": "all",
            "world_size": 1, "rank": 0, "not_recorded_phases": "weights,forward,loss,backward",
            "not_recorded_why": "Megatron-LM's wgrads hold gradients only",
        }

    # ------------------------------------------------------------------ the reader contract
    def close(self) -> None:
        self._cache.clear()
        self._archives.clear()

    def forget(self, step: int) -> None:
        self._cache.pop(step, None)

    def step_attrs(self, step: int) -> dict[str, Any]:
        return {"complete": 1, "records": len(self.records(step)), "iteration": step + 1}

    def scalars(self) -> dict[str, dict[int, float]]:
        return {}  # the gradient files hold no loss

    def nbytes(self) -> int:
        return sum(os.path.getsize(f) for f in self._files.values())

    def records(self, step: int) -> list[Record]:
        if step not in self._cache:
            if step not in self.steps:
                raise CaptureFileError(f"{self.path}: holds no step {step} (iterations "
                                       f"{[s + 1 for s in self.steps]}: steps {self.steps})")
            self._cache[step] = self._build(step)
        return self._cache[step]

    def array(self, record: Record) -> np.ndarray | None:
        if record.step not in self._cache and record.step in self.steps:
            self.records(record.step)  # a record of another reader of the same files: this one's index first
        where = self._where.get((record.step, record.seq))
        if where is None:
            return None
        arr, name = self._archive(where[0]).array(where[1])
        return dtypes.from_storage(arr, name)

    # ------------------------------------------------------------------ reading
    def _archive(self, file: str) -> TorchArchive:
        if file not in self._archives:
            self._archives[file] = TorchArchive(file, "dicts of tensors under names", _FIX)
        return self._archives[file]

    def _build(self, step: int) -> list[Record]:
        out: list[Record] = []
        file = self._files[("wgrads", step + 1)]
        archive = self._archive(file)
        chunks = sorted({key[0] for key in archive.keys if len(key) == 2})
        if any(len(key) != 2 for key in archive.keys) or not chunks:
            raise CaptureFileError(f"{file}: expected {{'model_chunk0': {{name: tensor}}}}; {_FIX}")
        if chunks != ["model_chunk0"]:
            raise CaptureFileError(f"{file}: holds {', '.join(chunks)}; tensordiff reads one model chunk "
                                   "(no virtual pipeline stages)")
        for key in archive.keys:
            module, _, slot = key[1].rpartition(".")
            x = np.asarray(dtypes.from_storage(*archive.array(key)), np.float64)
            finite = x[np.isfinite(x)]
            seq = len(out)
            self._where[(step, seq)] = (file, key)
            out.append(Record(
                step=step, seq=seq, phase="param_grad", module=module, call=0, kind="grad", slot=slot,
                module_class="", dtype=archive.dtype(key), shape=archive.shape(key),
                min=float(finite.min()) if finite.size else math.nan,
                max=float(finite.max()) if finite.size else math.nan,
                mean=float(finite.mean()) if finite.size else math.nan,
                l2=float(np.sqrt(np.sum(finite * finite))), nan=int(np.isnan(x).sum()), inf=int(np.isinf(x).sum()),
                numel=int(x.size), has_data=True))
        return out
