"""tensordiff reads Megatron-LM --save folders (tensordiff/ckpt/megatron_dir.py) written by the real megatron-core
loop (examples/megatron_loop/train.py: megatron-core's DDP, distributed optimizer, dist_checkpointing): torch_dist
(a PyTorch distributed checkpoint, read without unpickling) and torch (mp_rank_XX[_YYY] shards joined), the model
under megatron-core's names and Adam's moments per parameter; bad or partial folders are one line. No mocks."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from helpers import subprocess_env

from tensordiff.ckpt import files as ckpt_files
from tensordiff.ckpt import megatron_dir
from tensordiff.cli import main
from tensordiff.errors import CheckpointError

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
LOOP = os.path.join(ROOT, "examples", "megatron_loop", "train.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
LAYER0 = "decoder.layers.0."
PARAMS = 15  # the tiny GPT of examples/distributed/mcore_train.py: 2 layers x 6 + embedding, final norm, output


def _env() -> dict[str, str]:
    return subprocess_env(ROOT)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The loop's --save folders: TP=1 torch_dist and torch (3 iterations, saved at 2 and 3, weight decay on), TP=1
    torch_dist with lr 0 (the weights stay the initial ones), TP=2 torch with lr 0 under torchrun, the first run's
    training again with the optimizer state saved per bucket (dp_reshardable; DP=1 and DP=2 under torchrun), and the
    initial weights (--save-init: the full model, megatron-core names)."""
    tmp = tmp_path_factory.mktemp("mdir")
    train = ["--train-iters", "3", "--save-interval", "2", "--weight-decay", "0.1"]
    plans = [
        ("torch_dist", [sys.executable, LOOP, *train, "--save", str(tmp / "torch_dist"),
                        "--save-init", str(tmp / "init.safetensors")]),
        ("torch", [sys.executable, LOOP, *train, "--save", str(tmp / "torch"), "--ckpt-format", "torch"]),
        ("lr0", [sys.executable, LOOP, "--train-iters", "1", "--lr", "0", "--save", str(tmp / "lr0")]),
        ("tp2", [*TORCHRUN, LOOP, "--tp", "2", "--train-iters", "1", "--lr", "0", "--save", str(tmp / "tp2"),
                 "--ckpt-format", "torch"]),
        # the distributed optimizer's state per gradient bucket, Megatron-LM's default torch_dist layout: one process,
        # and two data-parallel ranks (each writes its half of every bucket)
        ("dp_reshardable", [sys.executable, LOOP, *train, "--save", str(tmp / "dp_reshardable"),
                            "--dist-ckpt-optim-sharding", "dp_reshardable"]),
        ("dp2", [*TORCHRUN, LOOP, *train, "--save", str(tmp / "dp2"), "--dist-ckpt-optim-sharding", "dp_reshardable"]),
    ]
    for i in range(0, len(plans), 2):  # two at a time (two cores)
        procs = [(name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                                         cwd=ROOT)) for name, cmd in plans[i:i + 2]]
        for name, proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, (name, out[-2000:], err[-3000:])
    from safetensors.numpy import load_file

    return {"tmp": tmp, "init": load_file(str(tmp / "init.safetensors"))}


def _model(tensors):
    return {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}


def test_iterations_lists_what_was_saved(saved):
    tmp = saved["tmp"]
    for fmt in ("torch_dist", "torch"):
        assert megatron_dir.iterations(str(tmp / fmt)) == {2: str(tmp / fmt / "iter_0000002"),
                                                           3: str(tmp / fmt / "iter_0000003")}
    assert megatron_dir.iterations(str(tmp / "tp2")) == {1: str(tmp / "tp2" / "iter_0000001")}


def test_a_torch_dist_folder_is_the_full_model_under_megatron_core_names(saved):
    tensors, skipped, info = megatron_dir.load_dir(str(saved["tmp"] / "lr0"))
    init = saved["init"]
    assert sorted(_model(tensors)) == sorted(init) and len(init) == PARAMS
    for name, value in init.items():  # lr 0: the initial weights, bit for bit, each layer unstacked
        assert tensors[name].dtype == value.dtype and np.array_equal(tensors[name], value), name
    assert info["format"] == "torch_dist" and info["iteration"] == 1 and info["tp"] == 1 and info["pp"] == 1
    assert info["step"] == 1 and info["rng_state"] is True and info["optimizer_layout"] == "fully_reshardable"
    assert skipped["rng_state"] == "object" and skipped["decoder.layers.mlp.linear_fc1._extra_state"] == "object"


def test_both_formats_hold_the_same_model_and_adam_moments(saved):
    tmp = saved["tmp"]
    dist, _, dinfo = megatron_dir.load_dir(str(tmp / "torch_dist"))
    torch_, _, tinfo = megatron_dir.load_dir(str(tmp / "torch"))
    assert sorted(dist) == sorted(torch_) and len(dist) == 3 * PARAMS  # model, exp_avg, exp_avg_sq
    for name in dist:
        assert np.array_equal(dist[name], torch_[name]), name
    moment = dist["optimizer.exp_avg." + LAYER0 + "mlp.linear_fc1.weight"]
    assert moment.shape == (256, 64) and float(np.abs(moment).max()) > 0
    assert float(dist["optimizer.exp_avg_sq.decoder.final_layernorm.weight"].min()) > 0
    assert not any(k.startswith("optimizer.fp32_param.") for k in dist)  # FP32 model: its main params are its own
    # trained: three Adam steps moved every weight away from the start
    assert not np.array_equal(dist[LAYER0 + "self_attention.linear_qkv.weight"],
                              saved["init"][LAYER0 + "self_attention.linear_qkv.weight"])
    for info in (dinfo, tinfo):
        assert info["iteration"] == 3 and info["step"] == 3
        assert info["scheduler"]["num_steps"] == 12 and info["scheduler"]["max_lr"] == 1e-3  # 3 x 4 samples
        assert info["args"]["weight_decay"] == 0.1 and info["args"]["num_layers"] == 2
        assert info["args"]["transformer_impl"] == "local" and info["args"]["data"] is None
    assert tinfo["format"] == "torch" and dinfo["format"] == "torch_dist"
    # an earlier iteration on request
    two, _, info2 = megatron_dir.load_dir(str(tmp / "torch"), iteration=2)
    assert info2["iteration"] == 2 and info2["step"] == 2
    assert not np.array_equal(two[LAYER0 + "mlp.linear_fc2.weight"], torch_[LAYER0 + "mlp.linear_fc2.weight"])


def test_tensor_parallel_shards_are_joined_into_the_full_model(saved):
    tensors, _, info = megatron_dir.load_dir(str(saved["tmp"] / "tp2"))
    assert info["tp"] == 2 and info["pp"] == 1 and info["step"] == 1
    for name, value in saved["init"].items():  # qkv per group, fc1 [gate; up] from [gate_r; up_r], rows, columns
        assert np.array_equal(tensors[name], value), name
    one, _, _ = megatron_dir.load_dir(str(saved["tmp"] / "lr0"))  # TP=1, the same first step
    for name in [k for k in one if k.startswith("optimizer.exp_avg.")]:
        np.testing.assert_allclose(tensors[name], one[name], rtol=1e-4, atol=1e-9, err_msg=name)


def test_ckpt_diff_of_the_two_formats_reports_identical(saved, capsys):
    tmp = saved["tmp"]
    assert main(["ckpt", "diff", str(tmp / "torch"), str(tmp / "torch_dist"), "--no-color", "--width", "120"]) == 0
    out = capsys.readouterr().out
    assert "45" in out and "identical" in out.lower()
    assert ckpt_files.load(str(tmp / "torch_dist" / "iter_0000002"))["decoder.final_layernorm.weight"].shape == (64,)


# ------------------------------------------------------------------------------------------- bad folders
def _copy(saved, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(saved["tmp"] / name, dst)
    return dst


def _one_line(path, says, **kw):
    with pytest.raises(CheckpointError) as err:
        megatron_dir.load_dir(str(path), **kw)
    text = str(err.value)
    assert len(text.splitlines()) == 1 and says in text, text
    return text


class _Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_bad_and_partial_folders_are_one_line(saved, tmp_path):
    dist = _copy(saved, "torch_dist", tmp_path)
    (dist / "latest_checkpointed_iteration.txt").write_text("300")
    _one_line(dist, "latest_checkpointed_iteration.txt names 300, but")
    _one_line(dist, "no iteration 5 (iter_0000005 is missing; saved: 2, 3)", iteration=5)
    os.remove(dist / "iter_0000003" / "__0_1.distcp")
    _one_line(dist, "__0_1.distcp: missing; the metadata stores", iteration=3)
    (dist / "iter_0000002" / ".metadata").write_bytes((dist / "iter_0000002" / ".metadata").read_bytes()[:500])
    _one_line(dist, "not a readable pickle", iteration=2)
    tp2 = _copy(saved, "tp2", tmp_path)
    shutil.rmtree(tp2 / "iter_0000001" / "mp_rank_01")
    _one_line(tp2, "mp_rank_01 missing of the 2 x 1 (TP x PP) rank folders")


def test_a_hostile_pickle_in_metadata_or_common_pt_is_refused_and_never_run(saved, tmp_path):
    import torch

    marker = tmp_path / "ran"
    dist = _copy(saved, "torch_dist", tmp_path)
    it3 = dist / "iter_0000003"
    (it3 / ".metadata").write_bytes(pickle.dumps(_Hostile(marker), protocol=4))
    text = _one_line(dist, "refused: loading it would call posix.system")
    assert str(it3 / ".metadata") in text and not marker.exists()
    it2 = dist / "iter_0000002"
    torch.save({"iteration": 2, "args": _Hostile(marker)}, it2 / "common.pt")
    text = _one_line(dist, "refused: loading it would call posix.system", iteration=2)
    assert str(it2 / "common.pt") in text and not marker.exists()


def test_dp_reshardable_buckets_are_split_into_per_parameter_moments(saved):
    """megatron-core's dp_reshardable layout (Megatron-LM's default with --use-distributed-optimizer): the same
    training as the fully_reshardable folder gives the same weights and moments, bit for bit, and the step"""
    tmp = saved["tmp"]
    for it in (2, 3):
        ref, _, ref_info = megatron_dir.load_dir(str(tmp / "torch_dist"), it)
        got, skipped, info = megatron_dir.load_dir(str(tmp / "dp_reshardable"), it)
        assert info["optimizer_layout"] == "dp_reshardable" and ref_info["optimizer_layout"] == "fully_reshardable"
        assert "optimizer_note" not in info and "optimizer buffer" not in skipped.values()
        assert info["step"] == it and info["iteration"] == it
        assert sorted(got) == sorted(ref) and len(got) == 3 * PARAMS
        for k, v in ref.items():
            np.testing.assert_array_equal(got[k], v, err_msg=k)
    # two data-parallel ranks wrote the buckets: read as well (another batch split: only the layout is checked here,
    # by the main parameters the reader finds where the weights are)
    got, skipped, info = megatron_dir.load_dir(str(tmp / "dp2"))
    assert info["optimizer_layout"] == "dp_reshardable" and "optimizer_note" not in info and info["step"] == 3
    assert len([k for k in got if k.startswith("optimizer.exp_avg_sq.")]) == PARAMS
    assert all(np.abs(v).max() > 0 for k, v in got.items() if k.startswith("optimizer.exp_avg"))


def test_a_dp_reshardable_bucket_that_does_not_fit_is_a_note_not_a_guess(saved, tmp_path):
    """a bucket layout the reader does not rebuild (here: the main parameters moved) is skipped with one note"""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    src = saved["tmp"] / "dp_reshardable" / "iter_0000003"
    dst = tmp_path / "iter_0000003"
    shutil.copytree(src, dst)
    meta = FileSystemReader(str(dst)).read_metadata()
    key = next(k for k in meta.state_dict_metadata if k.endswith("bucket_idx_0.param"))
    for idx, info in meta.storage_data.items():  # zero the first parameter's main copy in place
        if idx.fqn == key and idx.offset == torch.Size([0]):
            path = dst / info.relative_path
            data = bytearray(path.read_bytes())
            blob = bytes(data[info.offset: info.offset + info.length])
            import io

            from tensordiff.frameworks import torch_safe

            value = torch_safe.load_bytes(blob, "x")
            buf = io.BytesIO()
            torch.save(torch.full_like(value, 7.0), buf)
            new = buf.getvalue()
            assert len(new) == len(blob)
            data[info.offset: info.offset + info.length] = new
            path.write_bytes(bytes(data))
            break
    tensors, skipped, info = megatron_dir.load_dir(str(dst))
    assert "differs from the saved weight" in info["optimizer_note"]
    assert not [k for k in tensors if k.startswith("optimizer.")]
    assert list(skipped.values()).count("optimizer buffer") == 3
    assert len(tensors) == PARAMS
