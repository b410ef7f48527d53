"""Run-to-run noise of one side, as per-tensor tolerances that ``diff`` can use.

Two ways to measure it (``tensordiff noise``):

* two captures of the same run (``noise R1.h5 R2.h5 -o noise.json``): what nondeterministic kernels
  (atomics, split-K, another GPU) change between identical runs;
* one training command run twice (``noise -o noise.json -- python train.py``), the second time with every
  floating-point parameter moved by one unit in the last place, in a random direction, before the first
  step (``TENSORDIFF_PERTURB``; zeros stay zeros): how much rounding-level differences grow through the model. This is the
  floor below which no cross-framework difference can be told from rounding.

The file holds, per record of the runs (phase, module, call, kind, slot), the largest relative L2 error
seen. ``tensordiff diff A B --noise-file noise.json`` then allows each pair ``--noise-factor`` times it.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from typing import Any

from ..errors import NoiseFileError
from ..mapping import RenameRules
from ..store import open_capture
from .align import align_step
from .judge import compare_pair
from .tolerance import Tolerances

FORMAT = 1


def save(path: str, noise: dict[tuple, float], runs: list[str], how: str) -> None:
    records = [[*key, value] for key, value in sorted(noise.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2],
                                                                                     kv[0][3], kv[0][4]))]
    doc: dict[str, Any] = {
        "tensordiff_noise": FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "how": how,
        "runs": runs,
        "fields": ["phase", "module", "call", "kind", "slot", "rel_l2"],
        "records": records,
    }
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=0)
        fh.write("\n")


def load(path: str) -> dict[tuple, float]:
    if not os.path.isfile(path):
        raise NoiseFileError(f"{path}: no such noise file; make one with tensordiff noise R1.h5 R2.h5 -o {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as err:
        raise NoiseFileError(f"{path}: not a JSON noise file ({type(err).__name__}); make it again with tensordiff "
                             "noise") from None
    if not isinstance(doc, dict) or "tensordiff_noise" not in doc or not isinstance(doc.get("records"), list):
        raise NoiseFileError(f"{path}: not a tensordiff noise file (no 'tensordiff_noise' / 'records'); "
                             "make one with tensordiff noise")
    version = doc["tensordiff_noise"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise NoiseFileError(f"{path}: tensordiff_noise is {version!r}, not a format number (1..{FORMAT}); make the "
                             "file again with tensordiff noise")
    if version > FORMAT:
        raise NoiseFileError(f"{path}: noise format {doc['tensordiff_noise']} is newer than this tensordiff reads "
                             f"({FORMAT}); upgrade tensordiff")
    out: dict[tuple, float] = {}
    for i, rec in enumerate(doc["records"]):
        try:
            phase, module, call, kind, slot, value = rec
            if isinstance(value, bool) or isinstance(call, bool) or not isinstance(call, int) or any(
                    not isinstance(x, str) for x in (phase, module, kind, slot)):
                raise TypeError
            value = float(value)
        except (TypeError, ValueError):
            raise NoiseFileError(f"{path}: record {i} is not [phase, module, call, kind, slot, rel_l2] (text, text, an "
                                 f"integer call index, text, text, a number): {rec!r}; make the file again with "
                                 "tensordiff noise") from None
        if not math.isfinite(value) or value < 0:
            raise NoiseFileError(f"{path}: record {i} ({module} {kind}.{slot}) has noise {value!r}; expected a finite number "
                                 ">= 0")
        out[(str(phase), str(module), int(call), str(kind), str(slot))] = value
    return out


def summary(noise: dict[tuple, float]) -> dict[str, tuple[float, float, int]]:
    """Per phase: (median, max, count) of the measured noise."""
    by_phase: dict[str, list[float]] = {}
    for key, value in noise.items():
        by_phase.setdefault(key[0], []).append(value)
    out = {}
    for phase, values in by_phase.items():
        values.sort()
        out[phase] = (values[len(values) // 2], values[-1], len(values))
    return out


def measure_noise(path_1: str, path_2: str, mapping: RenameRules | None = None) -> dict[tuple, float]:
    """Per-record relative L2 error between two captures of the same run (the noise floor)."""
    out: dict[tuple, float] = {}
    loose = Tolerances(override=math.inf)
    with open_capture(path_1) as c1, open_capture(path_2) as c2:
        for step in sorted(set(c1.steps) & set(c2.steps)):
            for pair in align_step(c1.records(step), c2.records(step), mapping, order_fallback=False):
                if pair.matched:
                    metrics, _, _, _ = compare_pair(c1, c2, pair, loose, 0)
                    if metrics is not None and math.isfinite(metrics.rel_l2):
                        key = pair.a.key  # type: ignore[union-attr]
                        out[key] = max(out.get(key, 0.0), metrics.rel_l2)
    return out
