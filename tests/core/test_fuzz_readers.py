"""Fuzzing every reader: a damaged, truncated, edited, hostile or mis-encoded input is one line and exit 2 (or, where
the damage leaves a valid file, a normal verdict), never a traceback, an internal error (exit 4) or a hang.

Each input is read by the commands that read it, in this process (``cli.main``), under a time bound. Hypothesis
runs derandomized: the same cases on every run. ``TENSORDIFF_FUZZ_REPORT=FILE`` writes the tally of outcomes
(docs/reliability.md quotes it)."""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import h5py
import numpy as np
import pytest
from helpers import T, write_capture

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tensordiff import cli  # noqa: E402
from tensordiff.record import INDEX_DTYPE  # noqa: E402

#: The longest one command may take on one fuzzed input (a clean file takes well under a second).
TIME_BOUND = 15
FUZZ = settings(max_examples=int(os.environ.get("TENSORDIFF_FUZZ_EXAMPLES", "60")), deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck), database=None)
#: Byte-level damage of HDF5 files runs each command as its own process (about 0.7 s each): fewer cases.
PROCESS_FUZZ = settings(FUZZ, max_examples=max(1, FUZZ.max_examples // 2))
TALLY: Counter = Counter()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _report() -> None:
    target = os.environ.get("TENSORDIFF_FUZZ_REPORT")
    if target and TALLY:
        with open(target, "w", encoding="utf-8") as fh:
            json.dump(dict(sorted(TALLY.items())), fh, indent=1)


atexit.register(_report)


class Hang(Exception):
    pass


def _alarm(*_):
    raise Hang()


def run(argv: list[str], reader: str) -> tuple[int, str]:
    """``tensordiff ARGV`` in this process: (exit code, stderr). Asserts the outcome is clean."""
    err = io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIME_BOUND)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = cli.main(argv)
            except SystemExit as exc:  # argparse
                code = int(exc.code or 0)
    except Hang:
        TALLY[f"{reader}: hang"] += 1
        raise AssertionError(f"tensordiff {' '.join(argv)}: no answer within {TIME_BOUND} s") from None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return _tally(argv, reader, code, err.getvalue(), start)


def _tally(argv: list[str], reader: str, code: int, text: str, start: float) -> tuple[int, str]:
    TALLY["cases"] += 1
    TALLY[f"{reader}: exit {code}"] += 1
    TALLY["tracebacks"] += "Traceback" in text
    TALLY["internal errors"] += code == cli.EXIT_INTERNAL
    TALLY["crashes"] += code < 0 or code > 4
    TALLY["slowest (s)"] = max(TALLY["slowest (s)"], math.ceil(time.perf_counter() - start))
    assert "Traceback" not in text, text[-2000:]
    assert code in (0, 1, 2, 3), f"tensordiff {' '.join(argv)}: exit {code}: {text[-1000:]}"
    if code == 2:
        assert text.count("\n") == 1 and text.startswith("tensordiff: error: "), text
    return code, text


def run_command(argv: list[str], reader: str) -> tuple[int, str]:
    """``python -m tensordiff ARGV`` as its own process (HDF5 can loop inside one call on a damaged file, where only
    the command's watchdog, ``TENSORDIFF_READ_TIMEOUT``, ends it): (exit code, stderr), asserted clean."""
    env = dict(os.environ, TENSORDIFF_READ_TIMEOUT="5", PYTHONPATH=ROOT)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "tensordiff", *argv], capture_output=True, text=True, env=env,
                              timeout=TIME_BOUND * 4)
    except subprocess.TimeoutExpired:
        TALLY[f"{reader}: hang"] += 1
        raise AssertionError(f"tensordiff {' '.join(argv)}: no answer within {TIME_BOUND * 4} s") from None
    return _tally(argv, reader, proc.returncode, proc.stderr, start)


# -- a capture pair and the files every other reader reads ------------------------------------------------------------

def _steps(seed: int = 0) -> list[list[T]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        ts = [T("weights", f"decoder.layers.{i}.mlp.linear_fc1", "param", "weight",
                rng.standard_normal((8, 8)).astype(np.float32), module_class="Linear") for i in range(2)]
        x = rng.standard_normal((4, 8)).astype(np.float32)
        ts.append(T("forward", "", "input", "0", np.arange(8, dtype=np.int64).reshape(2, 4), module_class="GPT"))
        for i in range(2):
            name = f"decoder.layers.{i}.mlp.linear_fc1"
            ts.append(T("forward", name, "input", "0", x, module_class="Linear", enter=len(ts)))
            x = np.tanh(x @ rng.standard_normal((8, 8)).astype(np.float32))
            ts.append(T("forward", name, "output", "0", x, module_class="Linear", enter=len(ts) - 1))
        ts.append(T("forward", "decoder", "output", "0", x, module_class="Block", same_as=len(ts) - 1,
                    extra={"has_data": 1}))
        ts.append(T("loss", "", "loss", "0", np.array(float((x ** 2).mean()), dtype=np.float32)))
        for i in reversed(range(2)):
            ts.append(T("backward", f"decoder.layers.{i}.mlp.linear_fc1", "grad_output", "0",
                        rng.standard_normal((4, 8)).astype(np.float32), module_class="Linear"))
        for i in range(2):
            ts.append(T("param_grad", f"decoder.layers.{i}.mlp.linear_fc1", "grad", "weight",
                        rng.standard_normal((8, 8)).astype(np.float32), module_class="Linear"))
        out.append(ts)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    big = np.random.default_rng(1).standard_normal((128, 256)).astype(np.float32)  # chunked and compressed
    steps = _steps()
    steps[0].append(T("param_grad", "output_layer", "grad", "weight", big, module_class="Linear"))
    kw = {"losses": [1.0, 0.9], "scalars": {0: {"loss": 1.0, "grad_norm": 2.0}, 1: {"loss": 0.9, "grad_norm": 1.5}},
          "model_config": json.dumps({"num_layers": 2, "hidden_size": 8})}
    a = write_capture(str(folder / "a.h5"), steps, **kw)
    b = write_capture(str(folder / "b.h5"), steps, **kw)
    paths = {"a": a, "b": b, "folder": str(folder)}
    assert run(["noise", a, b, "-o", str(folder / "noise.json")], "setup")[0] == 0
    paths["noise"] = str(folder / "noise.json")
    assert run(["batch", "-o", str(folder / "batch.h5"), "--vocab", "100"], "setup")[0] == 0
    paths["batch"] = str(folder / "batch.h5")
    with open(folder / "map.yaml", "w", encoding="utf-8") as fh:
        fh.write("vars:\n  layers: 2\nrules:\n  - {b: 'decoder\\.layers\\.(\\d+)\\.mlp\\.linear_fc1', "
                 "a: 'decoder.layers.\\1.mlp.linear_fc1'}\nignore_b: ['^output_layer$']\norder_fallback: false\n")
    paths["map"] = str(folder / "map.yaml")
    with open(folder / "megatron.log", "w", encoding="utf-8") as fh:
        for it in range(1, 21):
            fh.write(f" [2026-11-30 04:00:00] iteration {it:8d}/      20 | consumed samples: {it * 8:5d} | "
                     f"learning rate: 3.000000E-04 | lm loss: {10 / it + 2:.6E} | grad norm: {1.5:.3f} |\n")
    paths["log"] = str(folder / "megatron.log")
    return paths


def _copy(files, name: str, suffix: str) -> str:
    target = os.path.join(files["folder"], f"fuzzed{suffix}")
    shutil.copyfile(files[name], target)
    return target


# -- byte-level damage: truncation, bit flips, spliced bytes -----------------------------------------------------------

HOSTILE = [b"\xff\xfe", b"\x00", b"nan", b"-1", b"1e999", b"[", b"{", b"'", b"*a", b": [1]", b"(.*.*)*z",
           b"&a [*a, *a, *a]", b"\xc3\x28", b"!!python/object/apply:os.system ['true']"]


@st.composite
def damage(draw, data: bytes) -> bytes:
    """``data`` truncated, with bits flipped, bytes spliced in or cut out."""
    buf = bytearray(data)
    how = draw(st.sampled_from(["truncate", "flip", "splice", "hostile", "cut"]))
    at = draw(st.integers(0, len(buf) - 1))
    if how == "truncate":
        return bytes(buf[:at])
    if how == "flip":
        for offset in draw(st.lists(st.integers(0, len(buf) - 1), min_size=1, max_size=8)):
            buf[offset] ^= 1 << draw(st.integers(0, 7))
    elif how == "splice":
        buf[at:at] = draw(st.binary(min_size=1, max_size=16))
    elif how == "hostile":
        buf[at:at] = draw(st.sampled_from(HOSTILE))
    else:
        del buf[at:at + draw(st.integers(1, 64))]
    return bytes(buf)


def _damaged_copy(files, name: str, suffix: str, draw) -> str:
    with open(files[name], "rb") as fh:
        data = fh.read()
    target = os.path.join(files["folder"], f"fuzzed{suffix}")
    with open(target, "wb") as fh:
        fh.write(draw(damage(data)))
    return target


@PROCESS_FUZZ
@given(st.data())
def test_a_damaged_capture_is_reported_as_damaged(files, data):
    path = _damaged_copy(files, "a", ".h5", data.draw)
    for argv in (["ls", "--records", path], ["diff", path, files["b"]], ["runs", path, files["b"]]):
        run_command(argv, "capture (bytes)")


@FUZZ
@given(st.data())
def test_a_damaged_mapping_file_is_one_error(files, data):
    path = _damaged_copy(files, "map", ".yaml", data.draw)
    run(["diff", files["a"], files["b"], "--mapping", path], "mapping file")


@FUZZ
@given(st.data())
def test_a_damaged_noise_file_is_one_error(files, data):
    path = _damaged_copy(files, "noise", ".json", data.draw)
    run(["diff", files["a"], files["b"], "--noise-file", path], "noise file")


@FUZZ
@given(st.data())
def test_a_damaged_training_log_is_one_error(files, data):
    path = _damaged_copy(files, "log", ".log", data.draw)
    run(["runs", path, files["log"]], "training log")


@PROCESS_FUZZ
@given(st.data())
def test_a_damaged_batch_file_is_one_error(files, data):
    path = _damaged_copy(files, "batch", ".h5", data.draw)
    run_command(["batch", "--check", path, "--vocab", "100"], "batch file")


@FUZZ
@given(st.data())
def test_a_damaged_checkpoint_table_is_one_error(files, data):
    pytest.importorskip("safetensors")
    from tensordiff.mapping import builtin

    files.setdefault("table", builtin()["mcore-mindformers"])
    if "ckpt" not in files:
        from safetensors.numpy import save_file

        files["ckpt"] = os.path.join(files["folder"], "c.safetensors")
        save_file({"decoder.layers.0.mlp.linear_fc1.weight": np.ones((4, 4), np.float32)}, files["ckpt"])
    path = _damaged_copy(files, "table", ".yaml", data.draw)
    run(["ckpt", "diff", files["ckpt"], files["ckpt"], "--mapping", path, "--sides", "mcore,mcore"], "checkpoint table")
    damaged_ckpt = _damaged_copy(files, "ckpt", ".safetensors", data.draw)
    run(["ckpt", "diff", damaged_ckpt, files["ckpt"]], "checkpoint (safetensors)")


# -- schema edits: the file stays valid HDF5, its content lies ---------------------------------------------------------

def _rewrite_index(f, fn):
    group = f["steps/000000"]
    rows = fn(group["index"][()])
    del group["index"]
    group.create_dataset("index", data=rows)


def _set(column, value, row=4):
    def edit(f):
        def fn(rows):
            rows = rows.copy()
            rows[column][row] = value
            return rows
        _rewrite_index(f, fn)
    return edit


def _without(column):
    def edit(f):
        names = [n for n in INDEX_DTYPE.names if n != column]
        _rewrite_index(f, lambda rows: np.array([tuple(r[n] for n in names) for r in rows],
                                                dtype=[(n, rows.dtype[n]) for n in names]))
    return edit


def _retype(column, dtype):
    def edit(f):
        def fn(rows):
            out = np.zeros(len(rows), dtype=[(n, dtype if n == column else rows.dtype[n]) for n in rows.dtype.names])
            for n in rows.dtype.names:
                if n != column:
                    out[n] = rows[n]
            return out
        _rewrite_index(f, fn)
    return edit


def _replace(name, value):
    def edit(f):
        del f[name]
        if isinstance(value, str) and value == "group":
            f.create_group(name)
        else:
            f[name] = value
    return edit


def _attr(name, value, where="/"):
    def edit(f):
        f[where].attrs[name] = value
    return edit


def _non_utf8_module(f):
    def fn(rows):
        out = np.zeros(len(rows), dtype=[(n, "S64" if n == "module" else rows.dtype[n]) for n in rows.dtype.names])
        for n in rows.dtype.names:
            out[n] = [v if isinstance(v, bytes) else v.encode() for v in rows[n]] if n == "module" else rows[n]
        out["module"][4] = b"\xff\xfe\xfd"
        return out
    _rewrite_index(f, fn)


def _scalars(edit_rows):
    def edit(f):
        rows = f["scalars"][()]
        rows = edit_rows(rows)
        del f["scalars"]
        f["scalars"] = rows
    return edit


def _bad_scalar_name(rows):
    rows["name"][0] = b"\xff\xfe"
    return rows


def _move(src, dst):
    def edit(f):
        f.move(src, dst)
    return edit


SCHEMA_EDITS = {
    "format attribute is text": _attr("tensordiff_format", "one"),
    "format attribute is a float": _attr("tensordiff_format", 1.5),
    "format attribute is an array": _attr("tensordiff_format", np.array([1, 2])),
    "format attribute is negative": _attr("tensordiff_format", -1),
    "format attribute from the future": _attr("tensordiff_format", 99),
    "framework attribute not UTF-8": _attr("framework", np.bytes_(b"\xff\xfetorch")),
    "model_config not JSON": _attr("model_config", "{not json"),
    "model_config a JSON list": _attr("model_config", "[1, 2]"),
    "parallel not JSON": _attr("parallel", "{bad"),
    "a step not named by a number": _move("steps/000001", "steps/abc"),
    "a step named -1": _move("steps/000001", "steps/-1"),
    "a step that is a dataset": _replace("steps/000001", np.arange(3)),
    "steps is a dataset": _replace("steps", np.arange(3)),
    "complete flag is text": _attr("complete", "yes", "steps/000000"),
    "complete flag is an array": _attr("complete", np.array([1, 1]), "steps/000000"),
    "index is a group": _replace("steps/000000/index", "group"),
    "index is plain integers": _replace("steps/000000/index", np.arange(5)),
    "index is two-dimensional": lambda f: _rewrite_index(f, lambda rows: np.stack([rows, rows])),
    "index is one row, not a table": lambda f: _rewrite_index(f, lambda rows: rows[0]),
    **{f"index without {c}": _without(c) for c in INDEX_DTYPE.names},
    **{f"index column {c} as {d}": _retype(c, d) for c, d in [
        ("seq", "f8"), ("shape", "i8"), ("phase", "i4"), ("numel", "f4"), ("has_data", "f8"), ("same_as", "f8"),
        ("module", "i8"), ("dtype", "i8"), ("nan", "f8")]},
    **{f"index row {c}={v!r}": _set(c, v) for c, v in [
        ("seq", 99), ("seq", -5), ("shape", "a,b"), ("shape", "-3,8"), ("shape", "8"), ("shape", "99999999999,99999999999"),
        ("numel", 7), ("numel", -1), ("dtype", "int8"), ("dtype", "nonsense"), ("dtype", "bfloat16"),
        ("dtype", "complex64"), ("dtype", "bool"), ("dtype", "float64"), ("has_data", 5), ("same_as", 999),
        ("same_as", 4), ("same_as", 0), ("same_as", -7), ("grad_of", 999), ("grad_of", -9), ("enter", 999),
        ("phase", "nope"), ("phase", ""), ("kind", ""), ("nan", -3), ("nan", 10 ** 6), ("call", -1), ("l2", -1.0)]},
    "a module name not UTF-8": _non_utf8_module,
    "a stored tensor missing": lambda f: f.__delitem__("steps/000000/data/4"),
    "the data group missing": lambda f: f.__delitem__("steps/000000/data"),
    "a tensor of the wrong size": _replace("steps/000000/data/4", np.zeros(5, np.float32)),
    "a tensor stored as float64": lambda f: _replace("steps/000000/data/4", f["steps/000000/data/4"][()].astype("f8"))(f),
    "a tensor stored as int8": lambda f: _replace("steps/000000/data/4", f["steps/000000/data/4"][()].astype("i1"))(f),
    "a tensor that is text": _replace("steps/000000/data/4", "hello"),
    "a tensor that is a group": _replace("steps/000000/data/4", "group"),
    "a tensor of records": _replace("steps/000000/data/4", np.zeros(16, dtype=[("a", "f4"), ("b", "f4")])),
    "a tensor that is one number": _replace("steps/000000/data/4", np.float32(3)),
    "scalars are plain numbers": _replace("scalars", np.arange(4.0)),
    "a scalar name not UTF-8": _scalars(_bad_scalar_name),
    "scalars with text steps": _scalars(lambda r: np.array([("x", n, v) for _, n, v in r],
                                                           dtype=[("step", h5py.string_dtype()), ("name", "S48"),
                                                                  ("value", "f8")])),
    "meta entry not UTF-8": lambda f: f.create_group("meta").create_dataset("model_config", data=np.bytes_(b"\xff{")),
    "meta entry of numbers": lambda f: f.create_group("meta").create_dataset("model_config", data=np.arange(3)),
    "meta entry a group": lambda f: f.create_group("meta/model_config"),
}


@pytest.mark.parametrize("name", sorted(SCHEMA_EDITS))
def test_an_edited_capture_is_reported_as_damaged_naming_what(files, name):
    path = _copy(files, "a", ".h5")
    with h5py.File(path, "r+") as f:
        SCHEMA_EDITS[name](f)
    codes = {}
    for argv in (["ls", "--records", path], ["diff", path, files["b"]], ["diff", files["b"], path],
                 ["noise", path, files["b"], "-o", path + ".json"], ["map", path, files["b"]]):
        codes[argv[0] if argv[0] != "diff" or argv[1] == path else "diff B A"] = run(argv, "capture (schema)")
    if "scalar" in name:  # only the run's scalars are damaged: ls and runs say so, the tensors still compare
        assert run(["ls", path], "capture (schema)")[0] == 2 and run(["runs", path, files["b"]], "capture (schema)")[0] == 2
        return
    for command in ("diff", "diff B A", "noise"):
        code, text = codes[command]
        assert code == 2, (command, code, text)
        assert path in text and ("damaged" in text or "newer than this tensordiff" in text), text


# -- hostile values that are well-formed: regex bombs, alias bombs -------------------------------------------------------

BOMBS = ["(.*.*)*z", "(a|a|ab)*c", "(\\w+\\.?)*#", "(x+x+)+y", "((.*)*)*Q", "(.*?,){25}P", "(\\d*|.)*\\d{2}!"]


@pytest.mark.parametrize("bomb", BOMBS)
@pytest.mark.parametrize("where", ["b", "ignore_a", "ignore_b"])
def test_a_regex_with_catastrophic_backtracking_is_stopped(files, tmp_path, bomb, where):
    mapping = tmp_path / "m.yaml"
    rule = f"  - {{b: '{bomb}', a: 'x'}}\n" if where == "b" else ""
    extra = f"{where}: ['{bomb}']\n" if where != "b" else ""
    mapping.write_text(f"rules:\n{rule}{extra}")
    code, text = run(["diff", files["a"], files["b"], "--mapping", str(mapping)], "mapping regex")  # run bounds a hang
    assert code in (0, 1, 2, 3)
    if code == 2:
        assert str(mapping) in text and "catastrophic backtracking" in text, text


def test_a_regex_that_backtracks_without_end_is_one_error_naming_it(tmp_path):
    """Python's re never returns on this pair (alternatives that match the same text, a failing tail); the bounded
    engine gives up after 0.5 s and says which regex, on which name."""
    mapping = tmp_path / "m.yaml"
    mapping.write_text("rules:\n  - {b: '(a|aa)*c', a: 'x'}\n")
    module = "a" * 60 + "ca"
    c = write_capture(str(tmp_path / "c.h5"), [[T("forward", module, "output", "0", np.ones(4, np.float32))]])
    code, text = run(["diff", c, c, "--mapping", str(mapping)], "mapping regex")
    assert code == 2
    assert f"{mapping}: rule 1: the regular expression '(a|aa)*c' takes over 0.5 s on the name '{module}'" in text
    assert "catastrophic backtracking" in text


def test_a_yaml_alias_bomb_is_refused_before_it_expands(files, tmp_path):
    mapping = tmp_path / "bomb.yaml"
    lines = ["vars:", "  a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    mapping.write_text("\n".join(lines + ["rules: []", ""]))
    code, text = run(["diff", files["a"], files["b"], "--mapping", str(mapping)], "mapping alias bomb")
    assert code == 2 and "aliases (*name) expand to over" in text
    table = tmp_path / "table.yaml"
    table.write_text(mapping.read_text())
    code, text = run(["ckpt", "convert", files["a"], str(tmp_path / "o.safetensors"), "--mapping", str(table)],
                     "checkpoint table alias bomb")
    assert code == 2 and "aliases (*name) expand to over" in text


def test_a_mapping_file_that_is_not_utf8_is_one_error(files, tmp_path):
    mapping = tmp_path / "m.yaml"
    mapping.write_bytes(b"rules:\n  - {b: 'caf\xe9', a: 'x'}\n")
    code, text = run(["diff", files["a"], files["b"], "--mapping", str(mapping)], "mapping file")
    assert code == 2 and "not UTF-8 text (byte 19" in text


# -- rank files of a distributed run ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranks")
    w = np.random.default_rng(3).standard_normal((4, 3)).astype(np.float32)
    x = np.random.default_rng(4).standard_normal((2, 4, 3)).astype(np.float32)
    for rank in range(2):
        part = np.split(w, 2, axis=0)[rank]
        coords = {"world_size": 2, "rank": rank, "tp": 2, "tp_rank": rank, "dp": 1, "dp_rank": 0, "pp": 1,
                  "source": "megatron.core.parallel_state"}
        rows = [T("weights", "fc", "param", "weight", part, module_class="ColumnParallelLinear"),
                T("forward", "fc", "input", "0", x, module_class="ColumnParallelLinear"),
                T("forward", "fc", "output", "0", x @ part.T, module_class="ColumnParallelLinear")]
        write_capture(str(folder / f"run.rank{rank}.h5"), [rows], parallel=json.dumps(coords),
                      param_splits=json.dumps({"fc.weight": {"tp": True, "sp": False, "dim": 0, "stride": 1}}))
    return folder


RANK_EDITS = {
    "parallel attribute not JSON": _attr("parallel", "{"),
    "parallel attribute a list": _attr("parallel", "[2]"),
    "param_splits not JSON": _attr("param_splits", "no"),
    "an index without shape": _without("shape"),
    "a tensor of the wrong size": _replace("steps/000000/data/2", np.zeros(3, np.float32)),
    "format attribute is text": _attr("tensordiff_format", "x"),
}


@pytest.mark.parametrize("name", sorted(RANK_EDITS))
def test_a_damaged_rank_file_is_named_by_merge_check_and_diff(ranks, tmp_path, name):
    for rank in range(2):
        shutil.copyfile(ranks / f"run.rank{rank}.h5", tmp_path / f"run.rank{rank}.h5")
    with h5py.File(tmp_path / "run.rank1.h5", "r+") as f:
        if name == "a tensor of the wrong size":
            _replace("steps/000000/data/2", np.zeros(3, np.float32))(f)
        else:
            RANK_EDITS[name](f)
    glob = str(tmp_path / "run.rank*.h5")
    for argv in (["merge", glob, "-o", str(tmp_path / "m.h5")], ["check", glob], ["diff", glob, glob]):
        code, text = run(argv, "rank files")
        if argv[0] == "check" and name == "a tensor of the wrong size":
            continue  # check compares what the ranks should hold alike (replicated tensors): not this sharded one
        assert code == 2 and "run.rank1.h5" in text, (argv, code, text)


def test_a_read_that_never_returns_ends_the_command_with_one_line(tmp_path):
    """The watchdog itself: a section that does not return (as HDF5 inside one call on some damaged files) is ended by
    the supervising process: one line naming the file and what was read, exit 2, within the bound."""
    program = ("import sys, time\n"
               "from tensordiff import _watchdog as watchdog\n"
               "code = watchdog.supervise()\n"
               "if code is not None:\n"
               "    sys.exit(code)\n"
               "with watchdog.section('run.h5', 'step 0 index'):\n"
               "    time.sleep(60)\n")
    env = dict(os.environ, TENSORDIFF_READ_TIMEOUT="1", PYTHONPATH=ROOT)
    # ended by the watchdog: the section sleeps 60 s, and a run past 50 s fails the test (TimeoutExpired)
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=50)
    assert proc.returncode == 2
    assert proc.stderr.startswith("tensordiff: error: run.h5: damaged: reading step 0 index did not return in 1 s")
    assert proc.stderr.count("\n") == 1
    env["TENSORDIFF_READ_TIMEOUT"] = "0"  # off: the program is not supervised (and here simply sleeps)
    proc = subprocess.run([sys.executable, "-c", program.replace("60", "0.1")], capture_output=True, text=True, env=env,
                          timeout=50)
    assert proc.returncode == 0 and proc.stderr == ""


TABLE_EDITS = [("sides: [mcore, mindformers]", "sides: mcore"), ("tensordiff_mapping: 2", "tensordiff_mapping: [2]"),
               ("    mcore: [.pt, .pth]", "    mcore: 5"), ("    choices: [interleaved, stacked]", "    choices: 7"),
               ("    default: interleaved", "    default: [1]"),
               ("    mcore:\n      - '*._extra_state'", "    mcorex:\n      - '*._extra_state'"),
               ("      - '*._extra_state'", "      - {a: 1}"), ("vars:\n", "vars: 5\nxvars:\n"),
               ("tensors:\n", "tensors: 3\nxtensors:\n"), ("  entries:\n", "  entries: 4\n  xentries:\n"),
               ("      shape: [vocab, hidden]", "      shape: 12"), ("      optional: true", "      optional: [x]")]


@pytest.mark.parametrize(("old", "new"), TABLE_EDITS)
def test_a_checkpoint_table_with_a_value_of_the_wrong_type_is_one_error(files, tmp_path, old, new):
    pytest.importorskip("safetensors")
    from safetensors.numpy import save_file

    from tensordiff.mapping import builtin

    with open(builtin()["mcore-mindformers"], encoding="utf-8") as fh:
        text = fh.read()
    assert old in text
    table = tmp_path / "t.yaml"
    table.write_text(text.replace(old, new, 1))
    ckpt = str(tmp_path / "c.safetensors")
    save_file({"decoder.layers.0.mlp.linear_fc1.weight": np.ones((4, 4), np.float32)}, ckpt)
    for argv in (["ckpt", "diff", ckpt, ckpt, "--mapping", str(table), "--sides", "mcore,mindformers"],
                 ["ckpt", "convert", ckpt, str(tmp_path / "o.safetensors"), "--mapping", str(table), "--to", "mindformers"]):
        code, text_ = run(argv, "checkpoint table (schema)")
        assert code == 2 and ("t.yaml" in text_ or "mapping t" in text_ or text_.startswith("tensordiff: error: t:")), text_
        assert "does not fit side" not in text_, text_  # the table's fault, not the checkpoint's


def test_an_empty_step_index_is_never_a_pass(files):
    """A step whose index holds no rows is a valid file with nothing in it: what B recorded there has no counterpart,
    so the diff is inconclusive (exit 3), never 'no divergence'."""
    path = _copy(files, "a", ".h5")
    with h5py.File(path, "r+") as f:
        _rewrite_index(f, lambda rows: rows[:0])
        del f["steps/000000/data"]
    for argv in (["diff", path, files["b"]], ["diff", files["b"], path]):
        code, _ = run(argv, "capture (schema)")
        assert code == 3


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
def test_killing_the_command_leaves_no_reader_behind(tmp_path):
    """The supervised child dies with the command (a SIGKILL of the command, as a CI timeout sends)."""
    program = ("import os, sys, time\n"
               "from tensordiff import _watchdog as watchdog\n"
               "code = watchdog.supervise()\n"
               "if code is not None:\n"
               "    sys.exit(code)\n"
               "print(os.getpid(), flush=True)\n"
               "with watchdog.section('run.h5', 'step 0 index'):\n"
               "    time.sleep(60)\n")
    env = dict(os.environ, TENSORDIFF_READ_TIMEOUT="120", PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True, env=env)
    child = int(proc.stdout.readline())
    assert child != proc.pid
    proc.kill()
    proc.wait(timeout=30)
    proc.stdout.close()

    def alive() -> bool:
        try:
            with open(f"/proc/{child}/status", encoding="utf-8") as fh:
                return "\nState:\tZ" not in fh.read()
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive()
