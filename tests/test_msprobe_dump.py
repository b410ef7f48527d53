"""msprobe's dumps read as captures (tensordiff/store/msprobe.py) and diffed against tensordiff's capture of the same
run: the tiny megatron-core GPT of examples/gpt/train.py (same seed, batches, optimizer).

The dumps are made by msprobe itself (PyPI mindstudio-probe) in the project's benchmark environment, .venv-bench
(benchmarks/setup_bench_env.sh); without it those tests skip, saying so. tests/data/msprobe_stats_gpt is msprobe's own
statistics dump (level L0, step 0) of this model, made by benchmarks/msprobe_dump.py --task statistics, so that
reading msprobe's format is tested in every checkout.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from tensordiff.errors import CaptureFileError
from tensordiff.store import MsprobeDump, open_capture
from tensordiff.store.torch_file import read_tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_PY = os.path.join(ROOT, ".venv-bench", "bin", "python")
FIXTURE = os.path.join(ROOT, "tests", "data", "msprobe_stats_gpt")
MAPPING = os.path.join(ROOT, "examples", "msprobe", "mcore_vs_msprobe.yaml")


def _msprobe_missing() -> str | None:
    if not os.path.exists(BENCH_PY):
        return "no .venv-bench (benchmarks/setup_bench_env.sh makes it, with msprobe from PyPI)"
    proc = subprocess.run([BENCH_PY, "-c", "import msprobe.pytorch"], capture_output=True, text=True)
    if proc.returncode:
        return f"msprobe not importable in .venv-bench: {proc.stderr.strip().splitlines()[-1:]}"
    return None


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "tensordiff", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT)


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """tensordiff's capture of step 0 of the run (full tensors)."""
    pytest.importorskip("megatron.core")
    from examples.gpt import train

    path = str(tmp_path_factory.mktemp("td") / "a.h5")
    train.main(["--capture", path, "--train-steps", "1", "--capture-steps", "1"])
    return path


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """msprobe's L0 tensor dumps of step 0: the clean run and the run with the LayerNorm epsilon fault."""
    why = _msprobe_missing()
    if why:
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("msprobe")
    out = {}
    for name, extra in (("clean", []), ("ln-eps", ["--fault", "ln-eps"])):
        path = str(folder / name)
        proc = subprocess.run([BENCH_PY, os.path.join(ROOT, "benchmarks", "msprobe_dump.py"), "--out", path,
                               "--task", "tensor", "--steps", "1", *extra], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        out[name] = path
    return out


# ------------------------------------------------------------------ with msprobe (.venv-bench)
def test_msprobe_tensor_dump_agrees_with_the_capture(capture, dumps):
    """(a) Every record of both sides compared and bitwise equal, or named by the mapping's ignore list (what one
    side does not record), or accounted by a rule: exit 0."""
    with MsprobeDump(dumps["clean"]) as dump:
        recs = dump.records(0)
        assert dump.attrs["msprobe_level"] == "L0" and dump.attrs["msprobe_task"] == "tensor"
        kinds = {(r.phase, r.kind) for r in recs}
        assert kinds == {("weights", "param"), ("forward", "input"), ("forward", "output"),
                         ("backward", "grad_output"), ("backward", "grad_input"), ("param_grad", "grad")}
        fc1 = [r for r in recs if r.module == "decoder.layers.0.mlp.linear_fc1" and r.phase == "backward"]
        # msprobe's backward 'input' are the gradients of the module's outputs: [16, 2, 256] for fc1 (64 -> 256)
        assert {(r.kind, r.slot, r.shape) for r in fc1} == {("grad_output", "0", (16, 2, 256)),
                                                           ("grad_output", "1", (256,)),
                                                           ("grad_input", "0", (16, 2, 64))}
    proc = _cli("diff", capture, dumps["clean"], "--mapping", MAPPING)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "0 diverged, 0 only in A, 0 only in B" in proc.stdout.replace("\n", " ")
    # without the mapping: exactly the records one side does not record are left, and nothing diverged
    from tensordiff.diff import DiffOptions, diff

    result = diff(capture, dumps["clean"], DiffOptions(order_fallback=False))
    assert result.outcome == "inconclusive" and result.first is None
    assert not [r for r in result.rows if r.verdict == "diverged"]
    left = sorted({(("A", r.pair.a) if r.pair.a else ("B", r.pair.b))[0] + " " + _name(r)
                   for r in result.rows if r.verdict == "unmatched" and not r.linked and r.accounted is None})
    assert left == [
        "A <model> grad_output",                     # msprobe does not hook the root model
        "A <model> output",
        "A decoder.layers.N.mlp.linear_fc1 grad",    # skip_bias_add biases: no parameters_grad from msprobe
        "A decoder.layers.N.mlp.linear_fc2 grad",
        "A decoder.layers.N.self_attention.linear_proj grad",
        "A loss loss",                               # the loss is computed outside the modules
        "B decoder.layers.N.input_layernorm grad_input",   # tensordiff keeps one gradient per tensor
        "B decoder.layers.N.pre_mlp_layernorm grad_input",
    ]


def _name(row) -> str:
    rec = row.pair.a or row.pair.b
    module = re.sub(r"layers\.\d+", "layers.N", rec.module) or "<model>"
    return f"{module} {rec.kind}"


def test_msprobe_dump_with_a_fault_names_the_module(capture, dumps):
    """(b) msprobe's dump of the run with decoder.layers.1.pre_mlp_layernorm's epsilon at 1e-2: the first divergence
    is that LayerNorm's output, and the epsilon hint solves both epsilons."""
    from tensordiff.diff import DiffOptions, diff
    from tensordiff.mapping import RenameRules

    result = diff(capture, dumps["ln-eps"], DiffOptions(mapping=RenameRules.load(MAPPING)))
    assert result.outcome == "diverged"
    first = result.first
    assert (first.step, first.phase, first.module_a, first.kind, first.introduced) == \
        (0, "forward", "decoder.layers.1.pre_mlp_layernorm", "output", True)
    proc = _cli("diff", capture, dumps["ln-eps"], "--mapping", MAPPING, "--first-divergence")
    assert proc.returncode == 1
    text = " ".join(proc.stdout.split())
    assert "norm-epsilon" in text and "epsilon A 1e-05, B 0.01" in text


def test_msprobe_pt_files_read_as_torch_saves_them(dumps):
    """Every .pt msprobe wrote is read without unpickling and matches dump.json's statistics."""
    with MsprobeDump(dumps["clean"]) as dump:
        stored = [r for r in dump.records(0) if r.has_data]
        assert len(stored) == len(dump.records(0))
        for rec in stored:
            x = dump.array(rec)
            assert x is not None and x.shape == rec.shape
            if rec.dtype == "float32" and x.size:
                assert float(x.max()) == rec.max and float(x.min()) == rec.min
                assert np.isclose(float(np.linalg.norm(x.astype(np.float64))), rec.l2, rtol=1e-5)


# ------------------------------------------------------------------ in every checkout
def test_statistics_fixture_reads_as_a_capture():
    """msprobe's own statistics dump (committed): the records, their kinds and statistics."""
    cap = open_capture(FIXTURE)
    assert isinstance(cap, MsprobeDump)
    assert cap.steps == [0] and cap.attrs["framework"] == "torch" and cap.attrs["tensors"] == "none"
    recs = cap.records(0)
    by = {(r.phase, r.module, r.kind, r.slot): r for r in recs}
    out = by[("forward", "decoder.layers.0.mlp.linear_fc1", "output", "0")]
    assert (out.module_class, out.shape, out.dtype, out.has_data) == ("ColumnParallelLinear", (16, 2, 256), "float32",
                                                                      False)
    assert out.parent == "decoder.layers.0.mlp" and recs[out.enter].module == "decoder.layers.0.mlp.linear_fc1"
    grad = by[("backward", "decoder.layers.0.mlp.linear_fc1", "grad_output", "0")]
    assert recs[grad.grad_of] is out
    assert by[("weights", "decoder.layers.1.self_attention.linear_qkv", "param", "weight")].shape == (192, 64)
    assert ("param_grad", "decoder.layers.0.mlp.linear_fc1", "grad", "weight") in by
    # forward records in the order the calls ran: a layer's input before its submodules', its output after theirs
    seqs = {(r.module, r.kind): r.seq for r in recs if r.phase == "forward" and r.slot in ("0", "hidden_states")}
    assert seqs[("decoder.layers.0", "input")] < seqs[("decoder.layers.0.input_layernorm", "input")] \
        < seqs[("decoder.layers.0.mlp", "output")] < seqs[("decoder.layers.0", "output")]
    assert open_capture(os.path.join(FIXTURE, "step0", "rank0", "dump.json")).records(0) == recs


def test_statistics_fixture_against_a_capture(capture):
    """The statistics dump against a capture of the same run: nothing diverges; what statistics cannot decide
    (integer and bool inputs: msprobe gives them no mean or norm) is named, so the outcome is inconclusive."""
    from tensordiff.diff import DiffOptions, diff
    from tensordiff.mapping import RenameRules

    result = diff(capture, FIXTURE, DiffOptions(mapping=RenameRules.load(MAPPING)))
    assert result.first is None and result.outcome == "inconclusive"
    assert any("forward: 13 pair(s) not compared from statistics: B holds no statistics of these integer or bool "
               "tensors (msprobe gives them no mean or norm)" in reason for reason in result.reasons), result.reasons
    assert not [r for r in result.rows if r.verdict == "diverged"]
    compared = [r for r in result.rows if r.verdict == "ok" and r.phase in ("forward", "backward")]
    assert len(compared) > 100


def test_hostile_pt_is_refused(tmp_path):
    """(c) A .pt whose pickle names os.system: one line, nothing run."""
    dump = tmp_path / "dump"
    shutil.copytree(FIXTURE, dump)
    folder = dump / "step0" / "rank0"
    meta = json.loads((folder / "dump.json").read_text())
    key = "Module.decoder.layers.0.mlp.linear_fc1.ColumnParallelLinear.forward.0"
    meta["data"][key]["output"][0]["data_name"] = f"{key}.output.0.pt"
    (folder / "dump.json").write_text(json.dumps(meta))
    (folder / "dump_tensor_data").mkdir()

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("x/data.pkl", pickle.dumps(Boom(), protocol=2))
        zf.writestr("x/byteorder", "little")
    (folder / "dump_tensor_data" / f"{key}.output.0.pt").write_bytes(buf.getvalue())
    cap = open_capture(str(dump))
    rec = next(r for r in cap.records(0) if r.module == "decoder.layers.0.mlp.linear_fc1" and r.kind == "output"
               and r.slot == "0")
    with pytest.raises(CaptureFileError) as err:
        cap.array(rec)
    msg = str(err.value)
    assert "\n" not in msg and f"{key}.output.0.pt: refused: it names " in msg and "system" in msg
    assert not (tmp_path / "pwned").exists()


def test_pickled_npy_is_refused(tmp_path):
    """A .npy holding Python objects (MindSpore dumps are .npy): refused, never loaded with allow_pickle."""
    dump = tmp_path / "dump"
    shutil.copytree(FIXTURE, dump)
    folder = dump / "step0" / "rank0"
    meta = json.loads((folder / "dump.json").read_text())
    key = "Module.decoder.final_layernorm.LayerNorm.forward.0"
    meta["data"][key]["output"][0]["data_name"] = "x.npy"
    (folder / "dump.json").write_text(json.dumps(meta))
    (folder / "dump_tensor_data").mkdir()
    np.save(folder / "dump_tensor_data" / "x.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    cap = open_capture(str(dump))
    rec = next(r for r in cap.records(0) if r.module == "decoder.final_layernorm" and r.kind == "output")
    with pytest.raises(CaptureFileError, match=r"x\.npy: refused: it holds Python objects"):
        cap.array(rec)


def test_truncated_dump_json_is_one_line(tmp_path):
    """(c) A dump.json cut short: one line naming it, the problem and the fix; exit 2 at the CLI."""
    dump = tmp_path / "dump"
    shutil.copytree(FIXTURE, dump)
    path = dump / "step0" / "rank0" / "dump.json"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(CaptureFileError) as err:
        open_capture(str(dump))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{path}: not valid JSON (") and "dump again with msprobe" in msg
    proc = _cli("diff", str(dump), str(dump))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "not valid JSON" in proc.stderr


def test_level_l1_dump_says_what_to_do(tmp_path):
    """An API-level (L1) dump names no modules: one line asking for L0 or mix."""
    folder = tmp_path / "dump" / "step0" / "rank0"
    folder.mkdir(parents=True)
    entry = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": 1.0, "Min": 0.0, "Mean": 0.5,
             "Norm": 1.0}
    (folder / "dump.json").write_text(json.dumps({"task": "statistics", "level": "L1", "framework": "pytorch",
                                                  "data": {"Functional.linear.0.forward": {"input_args": [entry],
                                                                                          "output": [entry]}}}))
    with pytest.raises(CaptureFileError, match=r"no module-level entries \(1 API-level ones: a level L1 dump\); "
                                               r"tensordiff lines up modules: dump at level L0 or mix"):
        open_capture(str(tmp_path / "dump")).records(0)


def test_torch_file_reads_what_torch_saves(tmp_path):
    """torch_file.read_tensor against torch.save itself: float32, bfloat16 (raw bits), int64, bool, a strided view."""
    torch = pytest.importorskip("torch")
    from tensordiff import dtypes

    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    cases = {"f32": base, "bf16": base.to(torch.bfloat16), "i64": torch.arange(12).reshape(3, 4),
             "bool": base > 0, "view": base[1:5, ::2].t()}
    for name, t in cases.items():
        path = str(tmp_path / f"{name}.pt")
        torch.save(t, path)
        arr, logical = read_tensor(path)
        assert arr.shape == tuple(t.shape)
        if logical == "bfloat16":
            assert np.array_equal(dtypes.from_storage(arr, logical).astype(np.float32), t.float().numpy())
        else:
            assert np.array_equal(arr, t.numpy()), name


def test_the_msprobe_page_runs_as_written(tmp_path):
    """docs/msprobe.md's run blocks (the committed statistics dump read as a capture), in a folder holding tests/."""
    import docblocks

    blocks = list(docblocks.blocks("docs/msprobe.md"))
    assert blocks and all(b.kind for b in blocks)
    os.symlink(os.path.join(ROOT, "tests"), tmp_path / "tests")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=ROOT)
    ran = [r for b in blocks if b.kind == "run" for r in docblocks.run_block(b, str(tmp_path), env)]
    assert ran and all(r.code == 0 for r in ran), [r.output[-1500:] for r in ran]
    assert "L0 statistics 235 (16, 2, 256)" in ran[0].output
