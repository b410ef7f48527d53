"""Distributed capture under torchrun (gloo, CPU): one file per rank, found and summarised, with each rank's
coordinates and megatron-core's parameter splits in the file. Real megatron-core, TP=2, two processes."""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from tensordiff.store import CaptureFile

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SCRIPT = os.path.join(ROOT, "examples", "distributed", "mcore_train.py")
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT, NO_COLOR="1", OMP_NUM_THREADS="1")
    for name in ("TENSORDIFF_OUTPUT", "TENSORDIFF_STEPS", "TENSORDIFF_TENSORS", "TENSORDIFF_DISABLE"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    if TORCHRUN is None:
        pytest.skip("torchrun is not installed next to this python")
    out = tmp_path_factory.mktemp("dist") / "tp2.h5"
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "capture", "-o", str(out), "--steps", "2", "--",
                           TORCHRUN, "--standalone", "--nproc_per_node", "2", SCRIPT, "--tp", "2"],
                          capture_output=True, text=True, env=_env(), timeout=600)
    return out, proc


def test_capture_under_torchrun_finds_and_summarises_every_rank_file(tp2):
    out, proc = tp2
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"tensordiff: wrote {out.parent / f'tp2.rank{rank}.h5'}: 2 step(s)" in proc.stdout
    assert "tensordiff: 2 rank file(s); diff them as one run, merged on read" in proc.stdout
    assert not out.exists()


def test_each_rank_file_holds_its_coordinates_and_the_parameter_splits(tp2):
    out, _ = tp2
    for rank in (0, 1):
        with CaptureFile(str(out.parent / f"tp2.rank{rank}.h5")) as cap:
            coords = json.loads(cap.attrs["parallel"])
            assert (coords["world_size"], coords["rank"], coords["tp"], coords["tp_rank"], coords["dp"], coords["pp"]) \
                == (2, rank, 2, rank, 1, 1)
            assert coords["tp_group"] == [0, 1] and coords["sequence_parallel"] is False
            splits = json.loads(cap.attrs["param_splits"])
            assert splits["decoder.layers.0.mlp.linear_fc1.weight"] == {"tp": True, "sp": False, "dim": 0, "stride": 2}
            assert splits["decoder.layers.0.self_attention.linear_proj.weight"]["dim"] == 1
            assert "decoder.layers.0.input_layernorm.weight" not in splits  # replicated, not marked
            qkv = [r for r in cap.records(0) if r.phase == "weights" and r.module.endswith("0.self_attention.linear_qkv")]
            assert qkv[0].shape == (64, 64)  # (4 + 2*2) x 16 rows / TP 2


# ----------------------------------------------------------------------------- merge on read
def _torchrun(folder, name, nproc, *args):
    out = folder / f"{name}.h5"
    cmd = ([TORCHRUN, "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]) + [
        SCRIPT, "--capture", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(out)


@pytest.fixture(scope="module")
def runs(tp2):
    """TP=1 reference, and the layouts and faults of the issue: each captured by the script itself, one file per rank."""
    folder = tp2[0].parent
    return {"ref": _torchrun(folder, "ref", 1),
            "tp2": str(folder / "tp2.rank*.h5"),
            "dp2": _torchrun(folder, "dp2", 2, "--dp", "2").replace(".h5", ".rank*.h5"),
            "tp2dp2": _torchrun(folder, "tp2dp2", 4, "--tp", "2", "--dp", "2").replace(".h5", ".rank*.h5"),
            "sp2": _torchrun(folder, "sp2", 2, "--tp", "2", "--sp").replace(".h5", ".rank*.h5"),
            "qkv": _torchrun(folder, "qkv", 2, "--tp", "2", "--fault", "qkv-split").replace(".h5", ".rank*.h5"),
            "fc1": _torchrun(folder, "fc1", 2, "--tp", "2", "--fault", "fc1-split").replace(".h5", ".rank*.h5"),
            "spnr": _torchrun(folder, "spnr", 2, "--tp", "2", "--sp", "--fault", "sp-noreduce").replace(".h5", ".rank*.h5"),
            "dpsum": _torchrun(folder, "dpsum", 2, "--dp", "2", "--fault", "dp-sum").replace(".h5", ".rank*.h5"),
            "nored": _torchrun(folder, "nored", 2, "--dp", "2", "--fault", "dp-noreduce").replace(".h5", ".rank*.h5")}


def _diff(runs, b, tmp_path, *extra):
    from tensordiff.cli import main

    report = tmp_path / "r.json"
    code = main(["diff", runs["ref"], runs[b], "--json", str(report), *extra])
    return code, json.loads(report.read_text()) if report.exists() else None


@pytest.mark.parametrize("layout", ["tp2", "sp2", "dp2", "tp2dp2"])
def test_rank_files_of_any_layout_merge_on_read_and_agree_with_the_single_device_run(runs, layout, tmp_path):
    code, report = _diff(runs, layout, tmp_path)
    assert code == 0 and report["outcome"] == "agree", report["inconclusive_reasons"]
    assert all(c["only_a"] == c["only_b"] == 0 and c["compared_a"] == c["recorded_a"]
               for c in report["coverage"].values())
    assert report["summary"]["shape_mismatch"] == 0 and report["summary"]["ok"] > 300


def test_one_rank_file_against_another_layout_names_the_missing_ranks(runs, capsys):
    from tensordiff.cli import main

    rank0 = runs["tp2"].replace("rank*", "rank0")
    assert main(["diff", runs["ref"], rank0]) == 2
    err = capsys.readouterr().err
    assert "rank 0 of a 2-rank run (TP 2)" in err and "missing ranks 1" in err and "tp2.rank*.h5" in err
    assert main(["diff", runs["ref"], runs["tp2dp2"].replace("rank*", "rank[01]")]) == 2
    assert "a run of 4 ranks needs one file per rank; missing rank(s) [2, 3]" in capsys.readouterr().err


def test_a_wrong_qkv_split_is_found_at_linear_qkv_with_the_row_permutation_named(runs, tmp_path):
    code, report = _diff(runs, "qkv", tmp_path)
    first = report["first_divergence"]
    assert code == 1 and (first["step"], first["phase"], first["module_a"]) == (
        0, "weights", "decoder.layers.0.self_attention.linear_qkv")
    top = report["hints"][0]
    assert top["cause"] == "layout" and top["title"].startswith("B's rows are A's rows in another order")
    assert "merged from tensor-parallel rank files" in top["evidence"]


def test_a_wrong_gated_fc1_split_is_found_at_linear_fc1_with_the_row_permutation_named(runs, tmp_path):
    code, report = _diff(runs, "fc1", tmp_path)
    first = report["first_divergence"]
    assert code == 1 and (first["step"], first["phase"], first["module_a"]) == (
        0, "weights", "decoder.layers.0.mlp.linear_fc1")
    top = report["hints"][0]
    assert top["cause"] == "layout" and "B 64-127 = A 128-191, B 128-191 = A 64-127" in top["title"]


def test_sequence_parallel_norm_grads_not_all_reduced_are_a_tp_partial_sum(runs, tmp_path):
    code, report = _diff(runs, "spnr", tmp_path)
    first = report["first_divergence"]
    assert code == 1 and (first["step"], first["phase"], first["module_a"]) == (
        0, "param_grad", "decoder.layers.0.input_layernorm")
    top = report["hints"][0]
    assert top["cause"] == "tp-partial" and top["explained"] > 0.99
    assert "the sum over its 2 tensor-parallel ranks reproduces A" in top["title"]


def test_the_cross_rank_check_alone_finds_unreduced_sequence_parallel_grads(runs, capsys):
    from tensordiff.cli import main

    assert main(["check", runs["spnr"], "--no-color"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "step 0: 5 record(s) that must be identical differ across ranks" in out
    assert "param_grad decoder.layers.0.input_layernorm grad weight: TP ranks 0/1 differ" in out
    assert "the gradients of 5 parameter(s) marked sequence_parallel differ across tensor-parallel ranks" in out
    assert main(["check", runs["sp2"], "--no-color"]) == 0
    assert "Consistent: every record that must be identical across ranks is." in capsys.readouterr().out


def test_dp_sum_instead_of_mean_is_the_gradient_reduction_with_factor_2(runs, tmp_path):
    code, report = _diff(runs, "dpsum", tmp_path)
    first = report["first_divergence"]
    assert code == 1 and (first["step"], first["phase"]) == (0, "param_grad")
    assert first["location"] == "in the gradient reduction" and first["where"]["reduction"] is True
    top = report["hints"][0]
    assert top["cause"] == "factor" and "B = 2 × A" in top["title"]


def test_merge_writes_one_capture_that_diffs_like_the_rank_files(runs, tmp_path, capsys):
    from tensordiff.cli import main

    out = tmp_path / "tp2dp2.h5"
    assert main(["merge", runs["tp2dp2"], "-o", str(out)]) == 0
    assert "merged from 4 rank files (TP 2 x DP 2)" in capsys.readouterr().out
    with CaptureFile(str(out)) as cap:
        assert json.loads(cap.attrs["merged_from"]) == {"files": 4, "tp": 2, "dp": 2}
    assert main(["diff", runs["ref"], str(out)]) == 0
    assert main(["merge", runs["tp2dp2"], "-o", str(out)]) == 2  # never overwritten without --force


def test_a_missing_dp_all_reduce_is_found_by_the_cross_rank_check_with_no_reference_run(runs, tmp_path):
    from tensordiff.cli import main

    report = tmp_path / "self.json"
    assert main(["diff", runs["nored"], runs["nored"], "--json", str(report)]) == 3  # the run against itself
    doc = json.loads(report.read_text())
    assert "A: embedding.word_embeddings grad weight: DP ranks 0/1 differ" in doc["rank_inconsistencies"]
    assert any("must be identical on every rank holding them differ" in r for r in doc["inconclusive_reasons"])
    code, _ = _diff(runs, "nored", tmp_path)
    assert code != 0
