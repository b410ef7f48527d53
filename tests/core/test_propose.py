"""`tensordiff map`: a mapping proposed from two captures of one checkpoint, for a pair no built-in fits.

A is Megatron-like ([S, B, H] activations, one fused ``attn.qkv`` packed per query group, ``mlp.fc1`` = [gate; up]);
B is Hugging Face-like ([B, S, H], ``q_proj``/``k_proj``/``v_proj``, ``gate``/``up``, a Conv1D-style ``c_proj``
stored [in, out], an activation module A runs as code). Both hold the same weights; every norm weight is ones.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import T, write_capture

from tensordiff.cli import main
from tensordiff.diff import DiffOptions, RenameRules, diff
from tensordiff.diff.propose import propose
from tensordiff.transforms import Chunk, QkvGroups

S, B, H, HEADS, GROUPS, HD, F = 3, 2, 4, 4, 2, 2, 6
RNG = np.random.default_rng(7)


def weights(layers=2):
    return [{"q": RNG.standard_normal((HEADS * HD, H)).astype(np.float32),
             "k": RNG.standard_normal((GROUPS * HD, H)).astype(np.float32),
             "v": RNG.standard_normal((GROUPS * HD, H)).astype(np.float32),
             "proj": RNG.standard_normal((H, HEADS * HD)).astype(np.float32),
             "gate": RNG.standard_normal((F, H)).astype(np.float32),
             "up": RNG.standard_normal((F, H)).astype(np.float32),
             "norm": np.ones(H, dtype=np.float32)} for _ in range(layers)]


def side_a(ws, x):
    recs = []
    for i, w in enumerate(ws):
        p = f"decoder.layers.{i}"
        recs += [T("weights", f"{p}.norm2", "param", "weight", w["norm"]),  # registered before norm, runs after it
                 T("weights", f"{p}.norm", "param", "weight", w["norm"]),
                 T("weights", f"{p}.attn.qkv", "param", "weight", QkvGroups(HEADS, GROUPS, 0).join([w["q"], w["k"], w["v"]])),
                 T("weights", f"{p}.attn.proj", "param", "weight", w["proj"]),
                 T("weights", f"{p}.mlp.fc1", "param", "weight", Chunk(2, 0).join([w["gate"], w["up"]]))]
    for i, w in enumerate(ws):
        p, xs = f"decoder.layers.{i}", np.swapaxes(x[i], 0, 1)  # [S, B, H]
        qkv = xs @ QkvGroups(HEADS, GROUPS, 0).join([w["q"], w["k"], w["v"]]).T
        recs += [T("forward", p, "input", "hidden_states", xs, module_class="Layer"),
                 T("forward", f"{p}.norm", "output", "0", xs * w["norm"], module_class="Norm"),
                 T("forward", f"{p}.norm2", "output", "0", 3 * xs * w["norm"], module_class="Norm"),
                 T("forward", f"{p}.attn", "input", "0", xs, module_class="Attention"),
                 T("forward", f"{p}.attn.qkv", "output", "0", qkv, module_class="Linear"),
                 T("forward", f"{p}.attn.proj", "output", "0", (xs @ w["q"].T) @ w["proj"].T, module_class="Linear"),
                 T("forward", f"{p}.mlp.fc1", "output", "0", xs @ Chunk(2, 0).join([w["gate"], w["up"]]).T,
                   module_class="Linear"),
                 T("forward", p, "output", "0", xs * 2, module_class="Layer")]
    return recs


def side_b(ws, x):
    recs = []
    for i, w in enumerate(ws):
        p = f"model.h.{i}"
        recs += [T("weights", f"{p}.ln", "param", "weight", w["norm"]),
                 T("weights", f"{p}.ln_2", "param", "weight", w["norm"]),
                 T("weights", f"{p}.attn.q_proj", "param", "weight", w["q"]),
                 T("weights", f"{p}.attn.k_proj", "param", "weight", w["k"]),
                 T("weights", f"{p}.attn.v_proj", "param", "weight", w["v"]),
                 T("weights", f"{p}.attn.c_proj", "param", "weight", np.ascontiguousarray(w["proj"].T)),
                 T("weights", f"{p}.mlp.gate", "param", "weight", w["gate"]),
                 T("weights", f"{p}.mlp.up", "param", "weight", w["up"])]
    for i, w in enumerate(ws):
        p, xb = f"model.h.{i}", x[i]  # [B, S, H]
        q, k, v = xb @ w["q"].T, xb @ w["k"].T, xb @ w["v"].T
        recs += [T("forward", p, "input", "0", xb, module_class="Block"),
                 T("forward", f"{p}.ln", "output", "0", xb * w["norm"], module_class="LayerNorm"),
                 T("forward", f"{p}.ln_2", "output", "0", 3 * xb * w["norm"], module_class="LayerNorm"),
                 T("forward", f"{p}.attn", "input", "hidden_states", xb, module_class="SelfAttention"),
                 T("forward", f"{p}.attn.q_proj", "output", "0", q, module_class="Linear"),
                 T("forward", f"{p}.attn.k_proj", "output", "0", k, module_class="Linear"),
                 T("forward", f"{p}.attn.v_proj", "output", "0", v, module_class="Linear"),
                 T("forward", f"{p}.attn.c_proj", "output", "0", q @ w["proj"].T, module_class="Conv1D"),
                 T("forward", f"{p}.mlp.gate", "output", "0", xb @ w["gate"].T, module_class="Linear"),
                 T("forward", f"{p}.mlp.up", "output", "0", xb @ w["up"].T, module_class="Linear"),
                 T("forward", f"{p}.mlp.act", "output", "0", np.tanh(xb @ w["gate"].T), module_class="Tanh"),
                 T("forward", p, "output", "0", xb * 2, module_class="Block")]
    return recs


@pytest.fixture()
def pair(tmp_path):
    ws = weights()
    x = [RNG.standard_normal((B, S, H)).astype(np.float32) for _ in ws]
    a = write_capture(str(tmp_path / "a.h5"), [side_a(ws, x)])
    b = write_capture(str(tmp_path / "b.h5"), [side_b(ws, x)])
    return a, b, ws, x


def test_parameters_match_by_value_and_joins_transposes_and_layer_numbers_are_found(pair):
    a, b, _, _ = pair
    prop = propose(a, b)
    assert prop.params_by_value == prop.params_total_b == 16
    text = prop.yaml()
    assert "tensordiff_mapping: 2" in text and "sides: [a, b]" in text   # the captures a.h5 and b.h5
    assert "    - b: ['model.h.{i}.attn.q_proj', 'model.h.{i}.attn.k_proj', 'model.h.{i}.attn.v_proj']" in text
    assert "      split: 'qkv_groups(heads=4, groups=2)'" in text
    assert "      split: 'chunk(n=2)'" in text
    assert "      params: {'weight': ['transpose']}" in text          # c_proj stored [in, out]
    # norm weights are all ones: paired by layer number, then in forward order (not registration order)
    assert "    - b: 'model.h.{i}.ln'    # parameters equal by value\n      a: 'decoder.layers.{i}.norm'\n" in text
    assert "    - b: 'model.h.{i}.ln_2'    # parameters equal by value\n      a: 'decoder.layers.{i}.norm2'\n" in text
    assert "    - b: 'model.h.{i}'    # holds the images of its submodules" in text
    assert "    slots: {'0': 'hidden_states'}" in text and "    slots: {'hidden_states': '0'}" in text
    assert "'swap01'" in text
    # A runs the activation as code: the diff accounts for B's module (inside its layer), so nothing is left to ignore
    assert "mlp.act" not in text and "ignore:" not in text


def test_the_proposal_agrees_as_written_with_the_activation_accounted_inside_its_layer(pair, tmp_path):
    a, b, _, _ = pair
    text = propose(a, b).yaml()
    res = diff(a, b, DiffOptions(mapping=RenameRules.from_text(text, "p.yaml")))
    # B's activation module, which A runs as code, has no counterpart: accounted by structure (inside a layer whose
    # compared records agree), not left to the user's ignore list
    accounted = {(r.pair.b.module, r.accounted.rule) for r in res.rows if r.accounted and r.pair.b is not None}
    assert res.exit_code == 0 and accounted == {("model.h.0.mlp.act", "inside"), ("model.h.1.mlp.act", "inside")}
    head, _, left = text.partition("#   ignore:")  # uncomment what the proposal left commented out, if anything
    accepted = head + "\n".join(line[2:] if line.startswith("#   ") else line for line in ("  ignore:" + left
                                                                                          ).splitlines()) if left else text
    res = diff(a, b, DiffOptions(mapping=RenameRules.from_text(accepted, "p.yaml")))
    assert res.exit_code == 0, res.reasons


def test_a_module_from_another_checkpoint_is_left_unmatched_with_the_reason(tmp_path):
    ws = weights()
    x = [RNG.standard_normal((B, S, H)).astype(np.float32) for _ in ws]
    other = [dict(w) for w in ws]
    other[1]["proj"] = RNG.standard_normal((H, HEADS * HD)).astype(np.float32)
    a = write_capture(str(tmp_path / "a.h5"), [side_a(ws, x)])
    b = write_capture(str(tmp_path / "b.h5"), [side_b(other, x)])
    prop = propose(a, b)
    assert prop.params_by_value == 15
    assert "match none of the other side's by value" in prop.unmatched_b["model.h.1.attn.c_proj"]
    assert "decoder.layers.1.attn.proj" in prop.unmatched_a


def test_the_cli_writes_the_file_and_refuses_to_overwrite(pair, tmp_path, capsys):
    a, b, _, _ = pair
    out = tmp_path / "m.yaml"
    assert main(["map", a, b, "-o", str(out)]) == 0
    said = capsys.readouterr().out
    said = " ".join(said.split())  # the console wraps at its width
    assert "parameters: 16 of B's 16 matched A's 10 by value at step 0 (10 of them joined into 4 of A's)" in said
    assert f"next: tensordiff diff {a} {b} --mapping {out}" in said
    assert RenameRules.load(str(out)).rules
    assert main(["map", a, b, "-o", str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err


def test_bad_input_is_one_line_and_exit_2(pair, tmp_path, capsys):
    a, _, _, _ = pair
    assert main(["map", a, str(tmp_path / "missing.h5")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.h5: no such file" in err
    assert main(["map", a, a, "--step", "5"]) == 2
    assert "have no step 5" in capsys.readouterr().err
