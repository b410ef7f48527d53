"""A step's records packed as the recorder hands them to the writer: the text fields of each row, and the number
fields of all rows as one float64 table (integers up to 2**53 are exact in float64).

A step has ~1,000 records; as dicts, filling in their statistics and packing them for the writer process cost a few
milliseconds of the training thread after the device's last kernel. Packed, the rows are built while the device is
still computing, and the statistics go into the table's columns in a few numpy operations.
"""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any

import numpy as np

__all__ = ["INT_FIELDS", "NUMBER_FIELDS", "StepRows", "as_dicts", "without_data"]

NUMBER_FIELDS = frozenset({"seq", "call", "min", "max", "mean", "l2", "nan", "inf", "numel", "has_data", "same_as",
                           "grad_of", "enter"})
INT_FIELDS = NUMBER_FIELDS - {"min", "max", "mean", "l2"}


class StepRows:
    """``fields`` (every row's keys, in order), ``text_fields`` and ``texts`` (one sequence a row),
    ``number_fields`` and ``table`` (float64, [rows, number fields])."""

    __slots__ = ("_json", "fields", "number_fields", "table", "text_fields", "texts")

    def __init__(self, fields: list[str], text_fields: list[str], texts: list[Any], number_fields: list[str],
                 table: np.ndarray):
        self.fields, self.text_fields, self.texts = fields, text_fields, texts
        self.number_fields, self.table = number_fields, table
        self._json: bytes | None = None

    @classmethod
    def pack(cls, rows: list[dict[str, Any]]) -> StepRows | None:
        """``rows`` packed; None for no rows, or rows that do not all have the same keys with numbers where numbers go."""
        if not rows:
            return None
        fields = list(rows[0])
        numbers = [key for key in fields if key in NUMBER_FIELDS]
        texts = [key for key in fields if key not in NUMBER_FIELDS]
        if len(numbers) < 2 or len(texts) < 2 or len(set(map(len, rows))) != 1:  # itemgetter of 2+ keys: tuples
            return None
        try:
            table = np.array(list(map(itemgetter(*numbers), rows)), dtype=np.float64).reshape(len(rows), len(numbers))
            text_rows = list(map(itemgetter(*texts), rows))
        except (KeyError, TypeError, ValueError):
            return None
        return cls(fields, texts, text_rows, numbers, table)

    def __len__(self) -> int:
        return len(self.texts)

    def texts_json(self) -> bytes:
        """``texts`` as JSON (a list of lists), encoded once."""
        if self._json is None:
            self._json = json.dumps(self.texts).encode("utf-8")
        return self._json

    def column(self, name: str) -> np.ndarray:
        """The number field ``name`` of every row: a view of the table (writing it changes the rows)."""
        return self.table[:, self.number_fields.index(name)]

    def dicts(self) -> list[dict[str, Any]]:
        """The rows as dicts, their keys in ``fields``' order, integer fields as ints."""
        texts, numbers, fields = self.text_fields, self.number_fields, self.fields
        ints = [key in INT_FIELDS for key in numbers]
        out = []
        for text, values in zip(self.texts, self.table.tolist()):
            got = dict(zip(texts, text))
            got.update((key, int(v) if is_int else v) for key, is_int, v in zip(numbers, ints, values))
            out.append({key: got[key] for key in fields})
        return out

    def without_data(self, seqs: Any) -> StepRows:
        """These rows with the full tensors of ``seqs`` gone: rows that held one (or linked to one) say ``has_data``
        0."""
        table = self.table.copy()
        if seqs and "has_data" in self.number_fields:
            gone = np.fromiter((int(s) for s in seqs), dtype=np.float64)
            col = self.number_fields.index("has_data")
            hit = np.isin(table[:, self.number_fields.index("seq")], gone)
            if "same_as" in self.number_fields:
                hit |= np.isin(table[:, self.number_fields.index("same_as")], gone)
            table[hit, col] = 0
        return StepRows(self.fields, self.text_fields, self.texts, self.number_fields, table)


def as_dicts(rows: list[dict[str, Any]] | StepRows) -> list[dict[str, Any]]:
    """Rows as a list of dicts, packed or not."""
    return rows.dicts() if isinstance(rows, StepRows) else rows


def without_data(rows: list[dict[str, Any]] | StepRows, seqs: Any) -> list[dict[str, Any]] | StepRows:
    """``rows`` with the full tensors of ``seqs`` gone: rows that held one (or linked to one) say ``has_data`` 0."""
    if isinstance(rows, StepRows):
        return rows.without_data(seqs)
    return [dict(row, has_data=0) if row["seq"] in seqs or row["same_as"] in seqs else row for row in rows]
