"""The reader contract (tensordiff/store/base.py): every reader keeps ``CaptureReader``, a reader lacking a
capability answers its stated default, a read plan is plain data a worker process can take, and where captures are
read (diff, explain, runs, cli, report, config) no reader is told apart by its class, probed for a capability, or read
through its private attributes (checked by parsing the modules: framework-free)."""

from __future__ import annotations

import ast
import inspect
import json
import os
import pickle

import numpy as np
import pytest
from helpers import T, write_capture

from tensordiff.diff.workers import PlannedSide
from tensordiff.store import (
    CaptureFile,
    CaptureReader,
    MegatronGradDump,
    MergedCapture,
    MsprobeDump,
    PipelineCapture,
    ReaderBase,
    open_capture,
)
from tensordiff.store.plan import FilePlan, MergePlan, MergeSpec, SumPlan, read_plan

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tensordiff")
MSPROBE_DUMP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "msprobe_stats_gpt")

READERS = (CaptureFile, MergedCapture, PipelineCapture, MsprobeDump, MegatronGradDump, PlannedSide)
#: The dunder methods the contract declares (the Protocol class's other dunders are typing's machinery)
_DUNDERS = {"__enter__", "__exit__"}


def _members() -> dict[str, object]:
    """The names ``CaptureReader`` declares: its attributes (annotated) and its methods and properties."""
    out: dict[str, object] = dict.fromkeys(CaptureReader.__annotations__)
    for name, value in vars(CaptureReader).items():
        if (not name.startswith("_") or name in _DUNDERS) and (callable(value) or isinstance(value, property)):
            out[name] = value
    return out


MEMBERS = _members()
#: What every reader reads; the rest of the contract are capabilities, with their stated defaults
READING_API = {"path", "attrs", "steps", "incomplete_steps", "framework", "records", "iter_records", "array",
               "step_attrs", "scalars", "nbytes", "close", "__enter__", "__exit__"}
CAPABILITIES = set(MEMBERS) - READING_API


def test_the_contract_names_the_reading_api_and_the_capabilities():
    assert set(MEMBERS) >= READING_API
    assert {"merged", "paths", "tp", "dp", "pp", "sp", "offsets", "plan", "same_stored", "forget", "tp_copies",
            "dp_copies", "tied_copies", "tied_copy_name", "received_from", "stage_of", "param_split",
            "inconsistent_records", "inconsistencies"} == CAPABILITIES


def _annotated(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}


@pytest.mark.parametrize("cls", READERS, ids=lambda c: c.__name__)
def test_every_reader_class_has_every_member_of_the_contract_with_its_parameters(cls):
    assert issubclass(cls, ReaderBase) and not getattr(cls, "__abstractmethods__", None)
    missing = [name for name in MEMBERS if not hasattr(cls, name) and name not in _annotated(cls)]
    assert not missing, f"{cls.__name__} lacks {missing}"
    for name, declared in MEMBERS.items():
        if callable(declared) and not isinstance(declared, property):
            want = list(inspect.signature(declared).parameters)
            got = list(inspect.signature(getattr(cls, name)).parameters)
            assert got == want, f"{cls.__name__}.{name}{tuple(got)}: the contract says {tuple(want)}"


def _plain(tmp_path) -> str:
    return write_capture(str(tmp_path / "one.h5"), [[T("forward", "fc", "output", "0", np.ones((2, 3), np.float32),
                                                      module_class="Linear")]])


def _ranks(tmp_path, name="dp", pp=1) -> str:
    """Two rank files: two data-parallel ranks (``pp=1``), or two pipeline stages of one layer each."""
    for rank in range(2):
        coords = {"world_size": 2, "rank": rank, "tp": 1, "tp_rank": 0, "dp": 2 // pp, "dp_rank": rank if pp == 1 else 0,
                  "pp": pp, "pp_rank": rank if pp > 1 else 0, "layer_offset": rank if pp > 1 else 0}
        recs = [T("forward", "", "input", "0", np.arange(4, dtype=np.int64).reshape(2, 2), module_class="Net"),
                T("forward", "decoder.layers.0", "output", "0", np.full((2, 2, 3), rank + 1.0, np.float32),
                  module_class="Linear")]
        write_capture(str(tmp_path / f"{name}.rank{rank}.h5"), [recs], parallel=json.dumps(coords))
    return str(tmp_path / f"{name}.rank*.h5")


def _megatron_grads(tmp_path) -> str:
    folder = tmp_path / "save" / "wgrads" / "iter_0000001"
    folder.mkdir(parents=True)
    (folder / "mp_rank_00.pth").write_bytes(b"")  # listed when opened, read only when a step's records are asked for
    return str(tmp_path / "save")


def test_every_reader_is_a_capture_reader(tmp_path):
    with open_capture(_plain(tmp_path)) as plain, open_capture(_ranks(tmp_path)) as dp, \
            open_capture(_ranks(tmp_path, "pp", pp=2)) as pp, open_capture(MSPROBE_DUMP) as dump, \
            open_capture(_megatron_grads(tmp_path)) as grads:
        readers = [plain, dp, pp, dump, grads, PlannedSide({}, "session")]
        assert [type(r) for r in readers] == list(READERS)
        assert all(isinstance(r, CaptureReader) for r in readers)
        assert [r.merged for r in readers] == [False, True, True, False, False, False]
        assert [(r.tp, r.dp, r.pp) for r in readers[1:3]] == [(1, 2, 1), (1, 1, 2)]
        assert [r.paths for r in readers[:3]] == [[plain.path]] + [[str(tmp_path / f"{n}.rank{k}.h5") for k in range(2)]
                                                                   for n in ("dp", "pp")]
        assert list(pp.offsets) == [0, 1] and pp.stage_of(pp.records(0)[-1]) == 1


def test_a_reader_without_a_capability_answers_its_stated_default(tmp_path):
    with open_capture(_plain(tmp_path)) as cap, open_capture(MSPROBE_DUMP) as dump:
        for reader in (cap, dump):
            rec = reader.records(reader.steps[0])[0]
            assert (reader.merged, reader.tp, reader.dp, reader.pp, reader.sp, list(reader.offsets)) == \
                (False, 1, 1, 1, False, [])
            assert reader.paths == [reader.path]
            assert [reader.tp_copies(rec), reader.dp_copies(rec), reader.tied_copies(rec), reader.received_from(rec),
                    reader.stage_of(rec)] == [None] * 5
            assert (reader.tied_copy_name(rec.module, rec.slot), reader.param_split(rec.module, rec.slot)) == ("", {})
            assert reader.inconsistencies(rec.step) == reader.inconsistent_records(rec.step) == []
        rec = cap.records(0)[0]
        assert cap.plan(rec) == FilePlan(cap.path, rec) and dump.plan(dump.records(0)[0]) is None
        assert not dump.same_stored(dump.records(0)[0], cap, rec)


def test_forget_drops_a_steps_records_and_they_are_read_again(tmp_path):
    with open_capture(_plain(tmp_path)) as cap:
        first = cap.records(0)
        cap.forget(0)
        again = cap.records(0)
        assert again == first and again is not first


def test_plans_are_plain_data_a_worker_process_takes_and_follows(tmp_path):
    with open_capture(_ranks(tmp_path)) as cap:
        rec = next(r for r in cap.records(0) if r.module == "decoder.layers.0")
        plan = cap.plan(rec)
        assert isinstance(plan, MergePlan) and len(plan.grid) == 2
        assert pickle.loads(pickle.dumps(plan)) == plan
        side = PlannedSide({(rec.step, rec.seq): plan}, "contract")
        np.testing.assert_array_equal(side.array(rec), cap.array(rec))
        leaf = plan.grid[0][0]
        total = SumPlan((FilePlan(*leaf), FilePlan(*leaf)))
        np.testing.assert_array_equal(read_plan(total, lambda path, r: np.full(r.shape, 2.0, np.float32)),
                                      np.full(leaf[1].shape, 4.0, np.float32))
    assert MergeSpec() == pickle.loads(pickle.dumps(MergeSpec()))


# ----------------------------------------------------------------------------- no probes outside store/
#: The stages that read captures (besides the store itself)
READING_STAGES = ("diff", "explain", "runs", "cli", "report", "config")


def _outside_store() -> list[tuple[str, ast.AST]]:
    out = []
    for stage in READING_STAGES:
        for folder, _, files in os.walk(os.path.join(PACKAGE, stage)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as fh:
                        out.append((os.path.relpath(path, os.path.dirname(PACKAGE)), ast.parse(fh.read())))
    return out


def _private_names() -> set[str]:
    """Private attributes and methods of the readers' classes (``self._x`` set or read, ``def _x``)."""
    names: set[str] = set()
    readers = {cls.__name__ for cls in (*READERS, ReaderBase)}
    for path in {inspect.getsourcefile(cls) or "" for cls in (*READERS, ReaderBase)}:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name in readers):
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                        and node.attr.startswith("_") and not node.attr.startswith("__"):
                    names.add(node.attr)
                elif isinstance(node, ast.FunctionDef) and node.name.startswith("_") and not node.name.startswith("__"):
                    names.add(node.name)
    return names


def test_where_captures_are_read_no_reader_is_told_apart_by_class_or_probed_or_read_privately():
    classes = {cls.__name__ for cls in READERS} | {"ReaderBase", "CaptureReader"}
    private = _private_names()
    bad = []
    for path, tree in _outside_store():
        for node in ast.walk(tree):
            where = f"{path}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                fn, args = node.func.id, node.args
                if fn in ("isinstance", "issubclass") and len(args) == 2:
                    named = {n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
                             for n in ([*args[1].elts] if isinstance(args[1], ast.Tuple) else [args[1]])}
                    if named & classes:
                        bad.append(f"{where}: {fn}(..., {', '.join(sorted(named & classes))})")
                if fn in ("getattr", "hasattr") and len(args) >= 2 and isinstance(args[1], ast.Constant) \
                        and args[1].value in CAPABILITIES | private:
                    bad.append(f"{where}: {fn}(..., {args[1].value!r})")
            elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq))
                                                        for op in node.ops):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Call) and isinstance(s.func, ast.Name) and s.func.id == "type" for s in sides) \
                        and any(isinstance(s, ast.Name) and s.id in classes for s in sides):
                    bad.append(f"{where}: type(...) compared with a reader class")
            elif isinstance(node, ast.Attribute) and node.attr in private \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                bad.append(f"{where}: reads {node.attr}")
    assert not bad, "readers are asked through CaptureReader only (its capabilities have defaults):\n" + "\n".join(bad)
