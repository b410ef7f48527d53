"""The shared batch file: written once, loaded by each framework with one call, checked against the model."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tensordiff import batch as batches
from tensordiff.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_written_batch_reads_back_with_seed_and_fields(tmp_path):
    path = str(tmp_path / "b.h5")
    assert main(["batch", "-o", path, "--vocab", "100", "--seq", "8", "--batch", "3", "--seed", "5"]) == 0
    b = batches.read(path, vocab_size=100)
    assert b.tokens.shape == (3, 8) and b.tokens.dtype == np.int64
    np.testing.assert_array_equal(b.tokens[:, 1:], b.labels[:, :-1])  # labels are the next tokens
    assert b.tokens.min() >= 1 and b.labels.max() < 100  # id 0 (padding) is not drawn
    assert b.attention_mask.shape == (3, 1, 8, 8) and b.attention_mask[0, 0, 0, 1] and not b.attention_mask[0, 0, 1, 0]
    np.testing.assert_array_equal(b.position_ids[2], np.arange(8))
    assert b.attrs["seed"] == 5 and b.attrs["source"] == "random" and b.attrs["vocab_size"] == 100
    again = batches.make(100, 8, 3, seed=5)  # the seed reproduces it
    np.testing.assert_array_equal(again.tokens, b.tokens)
    assert not np.array_equal(batches.make(100, 8, 3, seed=6).tokens, b.tokens)
    np.testing.assert_array_equal(batches.load(path)["stream"], np.concatenate([b.tokens, b.labels[:, -1:]], 1))


def test_text_source_is_utf8_bytes_with_its_hash(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(("The quick brown fox jumps over the lazy dog. " * 20).encode())
    b = batches.make(256, 16, 2, seed=1, text=str(text))
    raw = text.read_bytes()
    start = int(b.attrs["offsets"].split(",")[0])
    assert bytes(b.tokens[0].astype(np.uint8)) == raw[start:start + 16]
    assert b.attrs["tokenizer"] == "utf-8 bytes" and len(b.attrs["sha256"]) == 64


def test_loaders_give_each_framework_its_dtypes(tmp_path):
    torch = pytest.importorskip("torch")
    path = str(tmp_path / "b.h5")
    batches.save(path, batches.make(64, 4, 2, seed=0))
    t = batches.load(path, vocab_size=64, framework="torch")
    assert t["tokens"].dtype == torch.int64 and t["attention_mask"].dtype == torch.bool
    assert t["loss_mask"].dtype == torch.float32
    ms = pytest.importorskip("mindspore")
    m = batches.load(path, vocab_size=64, framework="mindspore")
    assert m["tokens"].dtype == ms.int32 and m["labels"].dtype == ms.int32
    np.testing.assert_array_equal(m["tokens"].asnumpy(), t["tokens"].numpy())


def _one_line(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tensordiff: error: ")
    for needle in needles:
        assert needle in err
    return err


def test_batch_that_does_not_fit_the_vocabulary(tmp_path, capsys):
    path = str(tmp_path / "b.h5")
    batches.save(path, batches.make(128, 16, 2, seed=0))
    top = int(batches.read(path).tokens.max())
    _one_line(capsys, ["batch", "--check", path, "--vocab", "64"], path, f"token id {top}",
              "vocabulary of 64", "--vocab 64")


def test_bad_batch_files(tmp_path, capsys):
    _one_line(capsys, ["batch", "--check", str(tmp_path / "none.h5")], "no such batch file")
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not hdf5 at all")
    _one_line(capsys, ["batch", "--check", str(junk)], str(junk), "not an HDF5 file")
    _one_line(capsys, ["batch", "-o", str(tmp_path / "x.h5"), "--vocab", "128", "--text", str(tmp_path / "t.txt")],
              "no such text file")
    short = tmp_path / "short.txt"
    short.write_text("abc")
    _one_line(capsys, ["batch", "-o", str(tmp_path / "x.h5"), "--vocab", "128", "--text", str(short)], "at least 256")


def test_training_script_refuses_a_batch_for_another_vocabulary(tmp_path):
    pytest.importorskip("megatron.core")
    path = str(tmp_path / "b.h5")
    batches.save(path, batches.make(1000, 16, 2, seed=0, low=500))  # ids >= 500, the model has 128
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "capture", "-o", str(tmp_path / "a.h5"), "--",
                           sys.executable, os.path.join(ROOT, "examples/megatron_vs_mindformers/megatron_side.py"),
                           "--family", "gpt2", "--batch", path], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("tensordiff: error:")]
    assert len(lines) == 1 and "vocabulary of 128" in lines[0] and "batch was written for vocab 1000" in lines[0]
    assert "Traceback" not in proc.stderr


def _captured_run(tmp_path, name="run.h5", tensors="all", steps=2, labels=True, shift=True):
    """A tiny torch model called as megatron-core's GPTModel is (tokens, position_ids, attention_mask, labels=,
    loss_mask=), captured for ``steps`` steps; returns the path and the [S+1] rows it trained on, step by step."""
    torch = pytest.importorskip("torch")
    import tensordiff

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 4)
            self.out = torch.nn.Linear(4, 32)

        def forward(self, tokens, position_ids, attention_mask, labels=None, loss_mask=None):
            logits = self.out(self.emb(tokens))
            if labels is None:
                return logits.mean()
            losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
            return (losses * loss_mask).sum() / loss_mask.sum()

    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / name)
    g = torch.Generator().manual_seed(3)
    rows = []
    with tensordiff.capture(model, path, steps=steps, tensors=tensors, optimizer=opt) as cap:
        for _ in range(steps + 1):
            stream = torch.randint(0, 32, (2, 9), generator=g)
            rows.append(stream)
            tokens, lab = stream[:, :-1], stream[:, 1:] if shift else torch.randint(0, 32, (2, 8), generator=g)
            mask = torch.ones(2, 8)
            mask[1, -1] = 0.0  # one label left out, as Megatron leaves out pad (and, with --eod-mask-loss, eod) labels
            pos = torch.arange(8).expand(2, 8)
            causal = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)[None, None]
            loss = model(tokens, pos, causal, labels=lab, loss_mask=mask) if labels else model(tokens, pos, causal)
            opt.zero_grad()
            loss.backward()
            opt.step()
            cap.step(loss)
    return path, torch.cat(rows[:steps]).numpy()


def test_batch_from_a_capture_is_what_the_run_trained_on(tmp_path, capsys):
    cap, rows = _captured_run(tmp_path)
    out = str(tmp_path / "b.h5")
    assert main(["batch", "--from-capture", cap, "-o", out, "--vocab", "32"]) == 0
    said = capsys.readouterr().out
    assert f"wrote {out}: 4 rows x seq 8 from the model's inputs of step(s) 0,1 of {cap}" in said
    assert "its loss mask counts 30 of 32 labels" in said
    b = batches.read(out, vocab_size=32)
    np.testing.assert_array_equal(b.stream(), rows)  # both captured steps, in order; the third step is not in it
    np.testing.assert_array_equal(b.loss_mask[:, -1], [1, 0, 1, 0])
    np.testing.assert_array_equal(b.position_ids[3], np.arange(8))
    assert b.attrs["source"] == "capture:run.h5" and b.attrs["steps"] == "0,1" and b.attrs["calls"] == 2
    assert b.attention_mask[0, 0, 0, 1] and not b.attention_mask[0, 0, 1, 0]


def test_batch_from_a_capture_as_mindrecord_rows(tmp_path, capsys):
    ds = pytest.importorskip("mindspore.dataset")
    cap, rows = _captured_run(tmp_path)
    out, mr = str(tmp_path / "b.h5"), str(tmp_path / "b.mindrecord")
    assert main(["batch", "--from-capture", cap, "-o", out, "--mindrecord", mr]) == 0
    said = capsys.readouterr().out
    assert "4 rows of input_ids [9] (MindRecord), 2 a step" in said and "leaves out 2 label(s)" in said
    assert ("id 0 occurs" in said) == bool((rows[:, :-1] == 0).any())
    read = np.stack([r["input_ids"] for r in ds.MindDataset(mr, shuffle=False).create_dict_iterator(output_numpy=True)])
    np.testing.assert_array_equal(read, rows)


def test_batch_from_a_capture_bad_input(tmp_path, capsys):
    first, _ = _captured_run(tmp_path, "first.h5", tensors="first")  # step 1 holds statistics only
    _one_line(capsys, ["batch", "--from-capture", first, "-o", str(tmp_path / "x.h5")], "step 1",
              "statistics only", "--tensors all")
    nolabels, _ = _captured_run(tmp_path, "nolabels.h5", labels=False)
    _one_line(capsys, ["batch", "--from-capture", nolabels, "-o", str(tmp_path / "x.h5")],
              "without token ids and labels", "inputs: 0, 1, 2")
    unshifted, _ = _captured_run(tmp_path, "unshifted.h5", shift=False)
    _one_line(capsys, ["batch", "--from-capture", unshifted, "-o", str(tmp_path / "x.h5")],
              "not the token ids shifted by one")
    good, _ = _captured_run(tmp_path, "good.h5")
    _one_line(capsys, ["batch", "--from-capture", good], "needs -o FILE")
    _one_line(capsys, ["batch", "--from-capture", good, "-o", str(tmp_path / "x.h5"), "--vocab", "8"],
              "does not fit the model's vocabulary of 8")
    _one_line(capsys, ["batch", "--from-capture", str(tmp_path / "run.rank*.h5"), "-o", str(tmp_path / "x.h5")],
              "one capture file, not a pattern")
    _one_line(capsys, ["batch", "--from-capture", str(tmp_path / "none.h5"), "-o", str(tmp_path / "x.h5")],
              "no such file")
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not hdf5")
    _one_line(capsys, ["batch", "--from-capture", str(junk), "-o", str(tmp_path / "x.h5")], str(junk))
    assert not os.path.exists(tmp_path / "x.h5")
