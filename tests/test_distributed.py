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
MANY = os.path.join(TESTS, "scripts", "dist_runs.py")  # several runs of SCRIPT in one launch
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


def _torchrun_many(folder, runs):
    """Several 2-rank runs of the script in one torchrun launch (tests/scripts/dist_runs.py: the same two processes,
    megatron's parallel state set up anew for each run): {name: its rank files' pattern}."""
    options = [" ".join([*args, "--capture", str(folder / f"{name}.h5")]) for name, args in runs.items()]
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", MANY, *options], capture_output=True,
                          text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: str(folder / f"{name}.rank*.h5") for name in runs}


@pytest.fixture(scope="module")
def runs(tp2):
    """TP=1 reference, and the layouts and faults of the issue: each captured by the script itself, one file per rank."""
    folder = tp2[0].parent
    return {"ref": _torchrun(folder, "ref", 1),
            "tp2": str(folder / "tp2.rank*.h5"),
            "tp2dp2": _torchrun(folder, "tp2dp2", 4, "--tp", "2", "--dp", "2").replace(".h5", ".rank*.h5"),
            **_torchrun_many(folder, {"dp2": ["--dp", "2"], "sp2": ["--tp", "2", "--sp"],
                                      "qkv": ["--tp", "2", "--fault", "qkv-split"],
                                      "fc1": ["--tp", "2", "--fault", "fc1-split"],
                                      "spnr": ["--tp", "2", "--sp", "--fault", "sp-noreduce"],
                                      "dpsum": ["--dp", "2", "--fault", "dp-sum"],
                                      "nored": ["--dp", "2", "--fault", "dp-noreduce"]})}


def _diff(runs, b, tmp_path, *extra):
    from tensordiff.cli import main

    report = tmp_path / "r.json"
    code = main(["diff", runs["ref"], runs[b], "--json", str(report), *extra])
    return code, json.loads(report.read_text()) if report.exists() else None


def _diff_reversed(runs, a, tmp_path, *extra):
    """The run's rank files given first, the reference second."""
    from tensordiff.cli import main

    report = tmp_path / "back.json"
    code = main(["diff", runs[a], runs["ref"], "--json", str(report), *extra])
    return code, json.loads(report.read_text()) if report.exists() else None


@pytest.mark.parametrize("layout", ["tp2", "sp2", "dp2", "tp2dp2"])
def test_rank_files_of_any_layout_merge_on_read_and_agree_with_the_single_device_run(runs, layout, tmp_path):
    code, report = _diff(runs, layout, tmp_path)
    assert code == 0 and report["outcome"] == "agree", report["inconclusive_reasons"]
    assert all(c["only_a"] == c["only_b"] == 0 and c["compared_a"] == c["recorded_a"]
               for c in report["coverage"].values())
    assert report["summary"]["shape_mismatch"] == 0 and report["summary"]["ok"] > 300


@pytest.fixture(scope="module")
def bias_runs(tmp_path_factory):
    """The same model with biases on every linear (megatron returns them apart, skip_bias_add: the bias shard of a
    ColumnParallelLinear on each TP rank) and learned absolute positions (a torch Embedding, batch first)."""
    folder = tmp_path_factory.mktemp("bias")
    arch = ("--bias", "--pos", "learned")
    return {"ref": _torchrun(folder, "ref", 1, *arch),
            **_torchrun_many(folder, {"tp2": ["--tp", "2", *arch], "sp2": ["--tp", "2", "--sp", *arch],
                                      "dp2": ["--dp", "2", *arch], "pp2": ["--pp", "2", *arch]})}


@pytest.mark.parametrize("layout", ["tp2", "sp2", "dp2", "pp2"])
def test_biases_and_learned_positions_merge_from_sharding_facts_and_agree(bias_runs, layout, tmp_path):
    """The returned bias is sharded as its parameter is (a fact of the rank files' parameter splits), never
    cross-checked as a replicated copy; position embeddings [B, S, H] are merged along the batch."""
    code, report = _diff(bias_runs, layout, tmp_path)
    assert code == 0 and report["outcome"] == "agree", report["inconclusive_reasons"]
    assert report["rank_inconsistencies"] == [] and report["summary"]["shape_mismatch"] == 0
    fc1_bias = [r for r in report["rows"] if r["step"] == 0 and r["a"] == "decoder.layers.0.mlp.linear_fc1 output.1"]
    assert [r["verdict"] for r in fc1_bias] == ["ok"]  # both sides return it apart: compared, shards joined
    pos = [r for r in report["rows"] if r["step"] == 0 and r["a"] == "embedding.position_embeddings output.0"]
    assert [r["verdict"] for r in pos] == ["ok"]


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
    # the rank files given first: the same place, the same hint, its sides named the other way
    code, back = _diff_reversed(runs, "spnr", tmp_path)
    assert code == 1 and back["first_divergence"]["module_a"] == "decoder.layers.0.input_layernorm"
    assert back["hints"][0]["cause"] == "tp-partial" and back["hints"][0]["explained"] > 0.99
    assert "A holds a partial sum: the sum over its 2 tensor-parallel ranks reproduces B" in back["hints"][0]["title"]


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
    assert code == 1 and (first["step"], first["phase"], first["kind"]) == (0, "param_grad", "grad")
    assert first["location"] == "in the data-parallel gradient reduction" and first["where"]["reduction"] is True
    assert first["where"]["local_grads_agree"] == first["where"]["local_grads"] == 15  # the local gradients agree
    top = report["hints"][0]
    assert top["cause"] == "factor" and top["title"].startswith("B = 2 × A (≈ 2, B's data-parallel size")


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
    # against the single-device run: each rank's own gradient was never averaged over DP, which is where it parts
    code, report = _diff(runs, "nored", tmp_path)
    first = report["first_divergence"]
    assert code == 1 and report["outcome"] == "diverged", report["inconclusive_reasons"]
    assert (first["step"], first["phase"], first["kind"]) == (0, "param_grad", "grad"), first
    assert first["location"] == "in the data-parallel gradient reduction", first["location"]


# ----------------------------------------------------------------------------- pipeline parallelism
@pytest.fixture(scope="module")
def pp_runs(tp2):
    """PP=2 (megatron's pipeline schedule, one stage per rank) against the TP=1 reference of ``runs``: clean, and two
    faults."""
    folder = tp2[0].parent
    ref = str(folder / "ref.h5") if (folder / "ref.h5").exists() else _torchrun(folder, "ref", 1)

    return {"ref": ref, **_torchrun_many(folder, {"pp2": ["--pp", "2"],
                                                  "ppbf": ["--pp", "2", "--fault", "pp-batch-first"],
                                                  "ppoff": ["--pp", "2", "--fault", "pp-layer-offset"]})}


def test_pipeline_stage_files_hold_their_stage_its_layer_offset_and_the_loss(pp_runs, capsys):
    from tensordiff.cli import main

    with CaptureFile(pp_runs["ref"]) as ref:
        ref_losses = [ref.step_attrs(step)["loss"] for step in ref.steps]
    for rank in (0, 1):
        with CaptureFile(pp_runs["pp2"].replace("rank*", f"rank{rank}")) as cap:
            coords = json.loads(cap.attrs["parallel"])
            assert (coords["world_size"], coords["rank"], coords["pp"], coords["pp_rank"], coords["layer_offset"],
                    coords["tp"], coords["dp"], coords["pp_group"]) == (2, rank, 2, rank, rank, 1, 1, [0, 1])
            weights = {r.module for r in cap.records(0) if r.phase == "weights"}
            assert "decoder.layers.0.mlp.linear_fc1" in weights  # stage-local numbers on every stage
            assert not any(m.startswith("decoder.layers.1") for m in weights)
            assert ("embedding.word_embeddings" in weights, "output_layer" in weights) == (rank == 0, rank == 1)
            # the loss, computed on the last stage and broadcast to the first, is the TP=1 run's
            assert [cap.step_attrs(step)["loss"] for step in cap.steps] == pytest.approx(ref_losses, abs=1e-6)
    assert main(["diff", pp_runs["ref"], pp_runs["pp2"].replace("rank*", "rank1")]) == 2
    assert "rank 1 of a 2-rank run (PP 2)" in capsys.readouterr().err


def test_pipeline_stages_merge_on_read_and_agree_with_the_single_device_run(pp_runs, tmp_path):
    from tensordiff.store import PipelineCapture, open_capture

    code, report = _diff(pp_runs, "pp2", tmp_path)
    assert code == 0 and report["outcome"] == "agree", report["inconclusive_reasons"]
    assert all(c["only_a"] == c["only_b"] == 0 and c["compared_a"] == c["recorded_a"] == c["recorded_b"]
               for c in report["coverage"].values())
    assert report["summary"]["shape_mismatch"] == 0 and report["summary"]["ok"] > 300
    assert report["rank_inconsistencies"] == []
    with open_capture(pp_runs["pp2"]) as cap, CaptureFile(pp_runs["ref"]) as ref:
        assert isinstance(cap, PipelineCapture) and cap.offsets == [0, 1]
        for step in ref.steps:  # the stages joined in the single-device run's own order, under its names
            assert [r.key for r in cap.records(step)] == [r.key for r in ref.records(step)]
            assert cap.step_attrs(step)["loss"] == pytest.approx(ref.step_attrs(step)["loss"], abs=1e-6)


def test_a_stage_handing_its_hidden_state_on_batch_first_is_found_where_the_next_stage_receives_it(pp_runs, tmp_path):
    code, report = _diff(pp_runs, "ppbf", tmp_path)
    first = report["first_divergence"]
    assert code == 1 and (first["step"], first["phase"], first["module_a"], first["kind"], first["slot"]) == (
        0, "forward", "decoder.layers.1", "input", "hidden_states")
    assert first["location"] == "between decoder.layers.0 and decoder.layers.1"
    top = report["hints"][0]
    assert top["cause"] == "pp-boundary" and top["explained"] > 0.99
    assert "handed over between pipeline stages (batch first)" in top["title"]
    assert (top["details"]["sender_stage"], top["details"]["receiver_stage"]) == (0, 1)
    code, back = _diff_reversed(pp_runs, "ppbf", tmp_path)  # the stage files given first
    assert code == 1 and back["hints"][0]["cause"] == "pp-boundary" and back["hints"][0]["title"].startswith(
        "A's pipeline stage 1 received") and "(batch first)" in back["hints"][0]["title"]


def test_a_stage_loading_its_layers_by_stage_local_numbers_is_found_at_layer_1s_weights(pp_runs, tmp_path):
    code, report = _diff(pp_runs, "ppoff", tmp_path)
    first = report["first_divergence"]
    assert code == 1 and (first["step"], first["phase"]) == (0, "weights")
    assert first["module_a"].startswith("decoder.layers.1.")
    top = report["hints"][0]
    assert top["cause"] == "pp-layer-offset" and top["explained"] > 0.99
    assert f"holds A's {first['module_a'].replace('layers.1', 'layers.0')}.weight as {first['module_a']}.weight" \
        in top["title"]


# ----------------------------------------------------------------------------- gradients before and after the DP reduction
@pytest.fixture(scope="module")
def dp_runs(tp2):
    """DP=2 with megatron-core's and torch's DistributedDataParallel, the BF16 all-reduce fault under each of the
    three reductions, and DP sum instead of mean at 4 ranks (TP=2 x DP=2); the TP=1 reference of ``runs``."""
    folder = tp2[0].parent
    ref = str(folder / "ref.h5") if (folder / "ref.h5").exists() else _torchrun(folder, "ref", 1)

    return {"ref": ref,
            **_torchrun_many(folder, {"dp2-megatron": ["--dp", "2", "--ddp", "megatron"],
                                      "dp2-torch": ["--dp", "2", "--ddp", "torch"],
                                      **{f"bf16-{ddp}": ["--dp", "2", "--ddp", ddp, "--fault", "bf16-allreduce"]
                                         for ddp in ("manual", "megatron", "torch")}}),
            "tp2dp2sum": _torchrun(folder, "tp2dp2sum", 4, "--tp", "2", "--dp", "2", "--fault",
                                   "dp-sum").replace(".h5", ".rank*.h5")}


@pytest.mark.parametrize("ddp", ["megatron", "torch"])
def test_dp2_under_megatron_or_torch_ddp_records_local_gradients_and_agrees_with_the_single_device_run(
        dp_runs, ddp, tmp_path):
    code, report = _diff(dp_runs, f"dp2-{ddp}", tmp_path)
    assert code == 0 and report["outcome"] == "agree", report["inconclusive_reasons"]
    assert all(c["only_a"] == c["only_b"] == 0 and c["compared_a"] == c["recorded_a"]
               and c["compared_b"] == c["recorded_b"] for c in report["coverage"].values())
    assert report["summary"]["shape_mismatch"] == 0 and report["rank_inconsistencies"] == []
    grads = report["coverage"]["param_grad"]
    assert (grads["recorded_a"], grads["recorded_b"]) == (2 * 15, 2 * 30)  # 2 steps of 15 (A), 15 local + 15 (B)
    with CaptureFile(dp_runs[f"dp2-{ddp}"].replace("rank*", "rank1")) as cap:
        local = [r for r in cap.records(1) if r.kind == "grad_local"]
        assert len(local) == 15 and all(r.has_data and r.dtype == "float32" for r in local)  # stored at every step
        assert local[0].label == "module.embedding.word_embeddings local grad weight"
        info = json.loads(cap.step_attrs(0)["grad_reduction"])
        assert info["by"] == f"{ddp} DDP" and info["dp"] == 2
        if ddp == "megatron":
            assert info["buffer_dtype"] == ["float32"] and info["scale"] == [0.5]


@pytest.mark.parametrize("ddp", ["manual", "megatron", "torch"])
def test_a_bf16_all_reduce_is_named_as_the_dp_reduction_with_its_dtype(dp_runs, ddp, tmp_path):
    code, report = _diff(dp_runs, f"bf16-{ddp}", tmp_path)
    first = report["first_divergence"]
    assert code == 1 and (first["step"], first["phase"], first["kind"]) == (0, "param_grad", "grad")
    assert first["location"] == "in the data-parallel gradient reduction" and first["where"]["data_parallel"] is True
    assert first["where"]["local_grads_agree"] == first["where"]["local_grads"] == 15  # the local gradients agree
    assert first["incoming_rel_l2"] < 1e-6 < 1e-3 < first["rel_l2"]
    local = [r for r in report["rows"] if r["step"] == 0 and r["stand_in"] == "a"]  # A's gradient vs B's local one
    assert len(local) == 15 and all(r["verdict"] == "ok" and r["b"].endswith("local grad weight") for r in local)
    top = report["hints"][0]
    assert top["cause"] == "dtype" and top["title"] == ("B reduces gradients in BF16; reduce in FP32 (megatron "
                                                        "grad_reduce_in_fp32, torch DDP without the bf16 compress hook)")
    assert top["explained"] > 0.99 and top["details"]["dp"] == 2 and top["details"]["share_local"] < 0.5
    by = {"manual": "the program, after backward", "megatron": "megatron DDP, gradient buffer float32",
          "torch": "torch DDP, comm hook bf16_compress_hook_gloo"}[ddp]
    assert f"B's reduction: {by}" in top["evidence"]


def test_dp_sum_at_4_ranks_is_the_reduction_with_the_factor_of_dp(dp_runs, tmp_path):
    code, report = _diff(dp_runs, "tp2dp2sum", tmp_path)
    first = report["first_divergence"]
    assert code == 1 and (first["step"], first["phase"]) == (0, "param_grad")
    assert first["location"] == "in the data-parallel gradient reduction"
    assert first["where"]["local_grads_agree"] == first["where"]["local_grads"] == 15
    top = report["hints"][0]
    assert top["cause"] == "factor" and top["details"]["factor"] == pytest.approx(2.0, rel=1e-5)
    assert top["title"].startswith("B = 2 × A (≈ 2, B's data-parallel size: B sums the gradients over its 2")


def test_capturing_local_gradients_changes_no_number_and_leaves_nothing_behind():
    """tests/scripts/dp_local_grads.py: each reduction trained 3 steps bare and with a 1-step capture."""
    if TORCHRUN is None:
        pytest.skip("torchrun is not installed next to this python")
    script = os.path.join(TESTS, "scripts", "dp_local_grads.py")
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", script], capture_output=True, text=True,
                          env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(cases) == 6
    for case in cases:
        assert case["same_weights"] is True, case
        assert (case["post_accumulate_grad_hooks"], case["bucket_group_attrs"]) == (0, 0), case
        assert (case["local_records"], case["steps"]) == (15, 1), case


def test_the_gradient_of_an_input_a_module_modifies_in_place_is_still_recorded(runs):
    # megatron's FP32 softmax masks its scores in place, on a view: the gradient hook on the input's old autograd
    # node never runs; the capture hooks the modified tensor too (BF16 runs copy first and always recorded it)
    with CaptureFile(runs["ref"]) as cap:
        grads = [r for r in cap.records(0) if r.kind == "grad_input" and r.module.endswith("scale_mask_softmax")]
        assert [r.module for r in grads] == [f"decoder.layers.{i}.self_attention.core_attention.scale_mask_softmax"
                                             for i in (1, 0)]
        assert all(r.numel == 4 * 4 * 16 * 16 and r.l2 > 0 for r in grads)


# ----------------------------------------------------------------------------- tied embeddings
@pytest.fixture(scope="module")
def tied_runs(tp2):
    """Tied embeddings (share_embeddings_and_output_weights, Megatron-LM's default): the single-process reference, TP=2
    (the output layer called with ``weight=`` the embedding's vocabulary shard), PP=2 (the last stage's copy of the
    word embeddings, its gradient all-reduced over the embedding group), DP=2, and PP=2 without that all-reduce."""
    folder = tp2[0].parent
    return {"ref": _torchrun(folder, "tied-ref", 1, "--tied"),
            **_torchrun_many(folder, {"tied-tp2": ["--tp", "2", "--tied"], "tied-pp2": ["--pp", "2", "--tied"],
                                      "tied-dp2": ["--dp", "2", "--tied"],
                                      "tied-nr": ["--pp", "2", "--tied", "--fault", "tied-noreduce"]})}


def test_a_parameter_passed_as_an_argument_is_recorded_as_that_parameter(tied_runs):
    """The tied output layer's ``weight=`` is the word embeddings' parameter itself: a link to its weights record on
    every rank (never a replicated copy of its own); the pipeline stages mark the two copies of the tied weight."""
    for path in (tied_runs["ref"], tied_runs["tied-tp2"].replace("rank*", "rank1")):
        with CaptureFile(path) as cap:
            recs = {r.seq: r for r in cap.records(0)}
            arg = next(r for r in recs.values() if r.label == "output_layer input.weight")
            assert arg.same_as >= 0 and recs[arg.same_as].label == "embedding.word_embeddings weight"
            assert arg.shape == recs[arg.same_as].shape == ((128 if "ref" in path else 64), 64)
    for rank, name in ((0, "embedding.word_embeddings.weight"), (1, "output_layer.weight")):
        with CaptureFile(tied_runs["tied-pp2"].replace("rank*", f"rank{rank}")) as cap:
            splits = json.loads(cap.attrs["param_splits"])
            assert [n for n, s in splits.items() if s.get("tied")] == [name]
            assert json.loads(cap.attrs["model_config"])["share_embeddings_and_output_weights"] is True


@pytest.mark.parametrize("layout", ["tied-tp2", "tied-pp2", "tied-dp2"])
@pytest.mark.parametrize("order", ["ref-first", "run-first"])
def test_tied_embeddings_merge_and_agree_with_the_single_device_run_in_either_order(tied_runs, layout, order,
                                                                                    tmp_path):
    from tensordiff.cli import main

    report = tmp_path / "r.json"
    sides = [tied_runs["ref"], tied_runs[layout]]
    assert main(["diff", *(sides if order == "ref-first" else sides[::-1]), "--first-divergence",
                 "--json", str(report)]) == 0
    doc = json.loads(report.read_text())
    assert doc["outcome"] == "agree" and doc["rank_inconsistencies"] == [] and doc["summary"]["shape_mismatch"] == 0
    assert all(c["only_a"] == c["only_b"] == 0 and c["compared_a"] == c["recorded_a"]
               for c in doc["coverage"].values())
    arg = [r["verdict"] for r in doc["rows"] if r["step"] == 0 and r["a"] == "output_layer input.weight"]
    assert arg == ["ok"]


def test_the_cross_rank_check_passes_clean_tied_runs_and_joins_the_stages_in_the_reference_order(tied_runs, capsys):
    from tensordiff.cli import main
    from tensordiff.store import open_capture

    for layout in ("tied-tp2", "tied-pp2"):
        assert main(["check", tied_runs[layout], "--no-color"]) == 0, capsys.readouterr().out
        assert "Consistent: every record that must be identical across ranks is." in capsys.readouterr().out
    with open_capture(tied_runs["tied-pp2"]) as cap, CaptureFile(tied_runs["ref"]) as ref:
        for step in ref.steps:  # the last stage's copy is the first stage's weight: no output_layer weight record
            assert [r.key for r in cap.records(step)] == [r.key for r in ref.records(step)]


def test_a_missing_embedding_all_reduce_across_pipeline_stages_is_found_at_the_tied_weight(tied_runs, tmp_path,
                                                                                          capsys):
    from tensordiff.cli import main

    code, report = _diff(tied_runs, "tied-nr", tmp_path, "--first-divergence")
    first = report["first_divergence"]
    assert code == 1 and (first["step"], first["phase"], first["module_a"], first["kind"]) == (
        0, "param_grad", "embedding.word_embeddings", "grad")
    assert "B: embedding.word_embeddings grad weight: PP ranks 0/1 differ" in report["rank_inconsistencies"]
    top = report["hints"][0]
    assert top["cause"] == "pp-tied" and top["explained"] > 0.99 and "(output_layer.weight)" in top["title"]
    assert main(["check", tied_runs["tied-nr"], "--no-color"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "param_grad embedding.word_embeddings grad weight: PP ranks 0/1 differ" in out
    assert "weights embedding.word_embeddings weight: PP ranks 0/1 differ" in out  # step 1: the copies drifted apart
    assert ("the gradients of the tied word embeddings' copies differ across pipeline stages "
            "(embedding.word_embeddings.weight on the first, output_layer.weight on the last)") in out
