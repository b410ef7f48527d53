"""A step's records packed for the writer (``store/rows.py``), the recorder's statistics put into them
(``recorder._fill_stats``) and the frame that carries them to the writer process."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from tensordiff.capturing.recorder import _fill_stats
from tensordiff.store.rows import StepRows, as_dicts, without_data
from tensordiff.store.writer_process import _frame


def _row(seq: int, **kw):
    row = {"seq": seq, "phase": "forward", "module": f"layers.{seq}", "call": 0, "kind": "output", "slot": "0",
           "module_class": "Linear", "dtype": "bfloat16", "shape": "2x8", "min": 0.0, "max": 0.0, "mean": 0.0,
           "l2": 0.0, "nan": 0, "inf": 0, "numel": 16, "has_data": 0, "same_as": -1, "grad_of": -1, "enter": seq,
           "parent": ""}
    row.update(kw)
    return row


def test_packed_rows_come_back_as_the_same_dicts():
    rows = [_row(0, min=-1.5, max=2.25, mean=0.125, l2=3.0, nan=2, inf=1, has_data=1),
            _row(1, module="a.b", slot="x.0", same_as=0, grad_of=0, enter=-1, numel=2 ** 40)]
    packed = StepRows.pack(rows)
    assert packed is not None and len(packed) == 2
    back = packed.dicts()
    assert back == rows
    assert [list(r) for r in back] == [list(r) for r in rows]  # the recorder's order of fields
    assert type(back[0]["nan"]) is int and type(back[1]["numel"]) is int and type(back[0]["min"]) is float
    assert json.loads(packed.texts_json()) == [list(t) for t in packed.texts]
    assert as_dicts(packed) == rows and as_dicts(rows) is rows


def test_rows_that_do_not_pack():
    assert StepRows.pack([]) is None
    uneven = [_row(0), {k: v for k, v in _row(1).items() if k != "parent"}]
    assert StepRows.pack(uneven) is None
    assert StepRows.pack([_row(0, numel="sixteen")]) is None


def test_without_data_packed_and_as_dicts_agree():
    rows = [_row(0, has_data=1), _row(1, has_data=1, same_as=0), _row(2, has_data=1), _row(3, has_data=1)]
    packed = StepRows.pack(rows)
    assert packed is not None
    got = without_data(packed, {0, 3})
    assert isinstance(got, StepRows)
    assert [r["has_data"] for r in got.dicts()] == [0, 0, 1, 0]
    assert [r["has_data"] for r in without_data(rows, {0, 3})] == [0, 0, 1, 0]
    assert [r["has_data"] for r in packed.dicts()] == [1, 1, 1, 1]  # the rows given are left as they were


def test_fill_stats_records_links_and_chains():
    rows = [_row(0, numel=4), _row(1, numel=0), _row(2, same_as=0), _row(3, same_as=2), _row(4, numel=8, has_data=1),
            _row(5, same_as=4)]
    packed = StepRows.pack(rows)
    assert packed is not None
    values = np.array([[-1.0, 3.0, 2.0, 5.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 9.0, 40.0, 7.0, 3.0, 0.0]])
    _fill_stats(packed, [0, 1, 4], values)
    got = packed.dicts()
    assert (got[0]["min"], got[0]["max"], got[0]["mean"], got[0]["l2"], got[0]["nan"], got[0]["inf"]) == \
        (-1.0, 3.0, 0.5, 5.0, 0, 1)
    assert got[1]["mean"] == 0.0  # no values: no mean
    assert got[4]["mean"] == 5.0 and got[4]["nan"] == 3
    for link, record in ((2, 0), (3, 0), (5, 4)):  # 3 links to 2, which links to 0
        assert {k: got[link][k] for k in ("min", "max", "mean", "l2", "nan", "inf", "has_data")} == \
            {k: got[record][k] for k in ("min", "max", "mean", "l2", "nan", "inf", "has_data")}
    assert got[5]["has_data"] == 1 and got[3]["same_as"] == 2  # the link itself is kept as recorded


def test_fill_stats_wants_one_row_of_six_a_record():
    packed = StepRows.pack([_row(0), _row(1)])
    assert packed is not None
    with pytest.raises(ValueError):
        _fill_stats(packed, [0, 1], np.zeros((1, 6)))


def test_frame_splices_encoded_fields():
    frame = _frame({"t": "step", "step": 3}, {"rows": json.dumps([["a", "b"]]).encode()})
    (n,) = struct.unpack("<Q", frame[:8])
    assert n == len(frame) - 8
    body = json.loads(frame[8:])
    assert body == {"t": "step", "step": 3, "rows": [["a", "b"]]}
