"""Accounting by structure and value (``tensordiff.diff.accounting``): each rule on synthetic captures, and its limits.

The captures are what the torch hooks record for a one-layer model::

    Net ('')  ->  layers.0 (Block)  ->  layers.0.attn (Attn: weight W, bias c)  [-> layers.0.attn.drop]

The real-model matrix (``examples/pairs``, ``tests/test_agreement_matrix.py``) checks the same rules end to end.
"""

from __future__ import annotations

import numpy as np
from helpers import T, write_capture

from tensordiff.diff import DiffOptions, diff

RNG = np.random.default_rng(7)
B, S, H = 2, 4, 3
X = RNG.standard_normal((B, S, H)).astype(np.float32)
W = RNG.standard_normal((H, H)).astype(np.float32)
C = RNG.standard_normal(H).astype(np.float32)
Y = (X @ W).astype(np.float32)
DY = RNG.standard_normal((B, S, H)).astype(np.float32)
DX = (DY @ W.T).astype(np.float32)
CAUSAL_BOOL = np.triu(np.ones((S, S), dtype=bool), 1)[None, None]                    # True = masked
CAUSAL_ADD = np.where(np.triu(np.ones((B, 1, S, S), dtype=bool), 1), np.float32(-np.inf), np.float32(0))
LINK = {"has_data": 1}


def layer(extra: list[T] | None = None, attn_out=Y, mask=None, returns_bias=False, attn_params=True) -> list[T]:
    """One step; ``extra`` records go inside the attention call, before its output."""
    recs = [T("weights", "layers.0.attn", "param", "weight", W, module_class="Attn")] if attn_params else []
    if returns_bias:
        recs.append(T("weights", "layers.0.attn", "param", "bias", C, module_class="Attn"))
    base = len(recs)
    recs += [T("forward", "", "input", "0", X, enter=base, module_class="Net"),
             T("forward", "layers.0", "input", "0", X, same_as=base, enter=base + 1, parent="", module_class="Block",
               extra=LINK),
             T("forward", "layers.0.attn", "input", "0", X, same_as=base, enter=base + 2, parent="layers.0",
               module_class="Attn", extra=LINK)]
    if mask is not None:
        recs.append(T("forward", "layers.0.attn", "input", "mask", mask, enter=base + 2, parent="layers.0",
                      module_class="Attn"))
    recs += extra or []
    out = len(recs)
    recs.append(T("forward", "layers.0.attn", "output", "0", attn_out, enter=base + 2, parent="layers.0",
                  module_class="Attn"))
    if returns_bias:
        recs.append(T("forward", "layers.0.attn", "output", "1", C, enter=base + 2, parent="layers.0",
                      module_class="Attn"))
    if returns_bias:  # the layer adds the bias its attention returned apart: a new tensor
        recs.append(T("forward", "layers.0", "output", "0", attn_out + C, enter=base + 1, module_class="Block"))
    else:
        recs.append(T("forward", "layers.0", "output", "0", attn_out, same_as=out, enter=base + 1,
                      module_class="Block", extra=LINK))
    recs += [
             T("backward", "layers.0.attn", "grad_output", "0", DY, grad_of=out, enter=base + 2, module_class="Attn"),
             T("backward", "layers.0.attn", "grad_input", "0", DX, grad_of=base + 2, enter=base + 2,
               module_class="Attn")]
    if attn_params:
        recs.append(T("param_grad", "layers.0.attn", "grad", "weight", (X.reshape(-1, H).T @ DY.reshape(-1, H)),
                      module_class="Attn"))
    return recs


def drop(module="layers.0.attn.drop", cls="Dropout", out=None, params=False) -> list[T]:
    """A parameter-free module called inside the attention on a tensor recorded nowhere else (its scores)."""
    scores = RNG.standard_normal((B, S, S)).astype(np.float32)
    recs = [T("forward", module, "input", "0", scores, module_class=cls, parent="layers.0.attn"),
            T("forward", module, "output", "0", scores.copy() if out is None else out, module_class=cls,
              parent="layers.0.attn")]
    if params:
        recs.insert(0, T("weights", module, "param", "weight", np.ones(S, dtype=np.float32), module_class=cls))
    return recs


def run(tmp_path, a: list[T], b: list[T]):
    pa = write_capture(str(tmp_path / "a.h5"), [a])
    pb = write_capture(str(tmp_path / "b.h5"), [b])
    return diff(pa, pb, DiffOptions(order_fallback=False))


def accounted(res) -> dict[str, str]:
    return {(r.pair.a or r.pair.b).label: r.accounted.rule for r in res.rows if r.accounted is not None}


def test_a_dropout_at_p0_inside_a_module_that_agrees_is_accounted_inside_it(tmp_path):
    res = run(tmp_path, layer(), layer(drop()))
    assert res.outcome == "agree", res.reasons
    assert accounted(res) == {"layers.0.attn.drop input.0": "inside", "layers.0.attn.drop output.0": "inside"}


def test_a_module_returning_a_compared_tensor_unchanged_is_a_pass_through(tmp_path):
    """An Identity on the attention's output (another object, the same values): it computes nothing."""
    b = layer()
    out = next(i for i, t in enumerate(b) if t.kind == "output" and t.module == "layers.0.attn")
    b[out + 1:out + 1] = [T("forward", "layers.0.post", "input", "0", Y, same_as=out, module_class="Identity",
                            parent="layers.0", extra=LINK),
                          T("forward", "layers.0.post", "output", "0", Y.copy(), module_class="Identity",
                            parent="layers.0")]
    for t in b:  # links and gradients after the insertion point name their seq two places further
        t.same_as += 2 if t.same_as > out else 0
        t.grad_of += 2 if t.grad_of > out else 0
        t.enter += 2 if t.enter > out else 0
    res = run(tmp_path, layer(), b)
    assert res.outcome == "agree", res.reasons
    row = next(r for r in res.rows if r.accounted is not None)
    assert (row.pair.b.label, row.accounted.rule) == ("layers.0.post output.0", "pass-through")
    assert "returns its input unchanged" in row.accounted.why


def test_an_active_dropout_is_reported_not_accounted_as_a_pass_through(tmp_path):
    noisy = RNG.standard_normal((B, S, S)).astype(np.float32)
    res = run(tmp_path, layer(), layer(drop(out=noisy)))
    assert res.exit_code == 3
    assert any("changes its input: an active dropout" in r and "layers.0.attn.drop" in r for r in res.reasons)


def test_a_record_under_the_model_itself_is_never_accounted_inside(tmp_path):
    """The enclosing module may not be the model (nor the decoder, nor a layer stack)."""
    res = run(tmp_path, layer(), layer(drop(module="scores_fn", cls="Softmax", out=-np.ones((B, S, S), np.float32))))
    assert res.exit_code == 3 and "scores_fn input.0" not in accounted(res)


def test_a_module_with_parameters_is_never_accounted_inside(tmp_path):
    res = run(tmp_path, layer(), layer(drop(cls="Scale", params=True, out=np.zeros((B, S, S), np.float32))))
    assert res.exit_code == 3 and not any(k.startswith("layers.0.attn.drop") for k in accounted(res))


def test_a_layer_stack_is_never_the_enclosing_module(tmp_path):
    """A mapping that pairs nothing inside the decoder: the decoder holds numbered layers, it cannot vouch for them."""
    a = [T("forward", "decoder", "input", "0", X, module_class="Dec"),
         T("forward", "decoder", "output", "0", Y, module_class="Dec")]
    b = a + [T("forward", "decoder.layers.0.act", "output", "0", -X, module_class="Tanh", parent="decoder")]
    res = run(tmp_path, a, b)
    assert res.exit_code == 3 and not accounted(res)


def test_masks_in_two_conventions_are_compared_by_meaning(tmp_path):
    res = run(tmp_path, layer(mask=CAUSAL_BOOL), layer(mask=CAUSAL_ADD))
    row = next(r for r in res.rows if r.pair.a is not None and r.pair.a.slot == "mask")
    assert res.outcome == "agree" and row.verdict == "ok" and row.note.startswith("masks compared by meaning")


def test_masks_that_mean_different_positions_diverge(tmp_path):
    window = CAUSAL_ADD.copy()
    window[..., 3, 0] = -np.inf                                                   # a sliding window on one side
    res = run(tmp_path, layer(mask=CAUSAL_BOOL), layer(mask=window))
    assert res.outcome == "diverged" and res.first.slot == "mask"


def test_a_causal_mask_the_other_side_does_not_pass_is_accounted_as_causal(tmp_path):
    res = run(tmp_path, layer(mask=CAUSAL_BOOL), layer())
    assert res.outcome == "agree" and accounted(res) == {"layers.0.attn input.mask": "mask"}
    not_causal = np.zeros((1, 1, S, S), dtype=bool)                               # masks nothing: not what B does
    res = run(tmp_path, layer(mask=not_causal), layer())
    assert res.exit_code == 3 and not accounted(res)
    # B passes only a padding mask of ones (Hugging Face's attention_mask) and masks causally itself
    ones = [T("forward", "layers.0.attn", "input", "attention_mask", np.ones((B, S), dtype=np.int64), enter=3,
              parent="layers.0", module_class="Attn")]
    res = run(tmp_path, layer(mask=CAUSAL_BOOL), layer(extra=ones))
    assert res.outcome == "agree" and accounted(res) == {"layers.0.attn input.mask": "mask",
                                                         "layers.0.attn input.attention_mask": "mask"}
    res = run(tmp_path, layer(mask=not_causal), layer(extra=ones))               # full attention is still not it
    assert res.exit_code == 3 and "layers.0.attn input.mask" not in accounted(res)


def test_a_bias_returned_apart_is_added_before_comparing(tmp_path):
    """megatron's skip_bias_add: (y, bias) on A, y + bias on B; B without its bias is found."""
    res = run(tmp_path, layer(returns_bias=True), layer(attn_out=Y + C, returns_bias=False) + [
        T("weights", "layers.0.attn", "param", "bias", C, module_class="Attn")])
    assert res.outcome == "agree", res.reasons
    assert accounted(res) == {"layers.0.attn output.1": "bias"}
    res = run(tmp_path, layer(returns_bias=True), layer(attn_out=Y, returns_bias=False) + [
        T("weights", "layers.0.attn", "param", "bias", C, module_class="Attn")])
    assert res.outcome == "diverged" and (res.first.module_a, res.first.slot) == ("layers.0.attn", "0")


def test_position_ids_on_one_side_only_are_accounted_when_they_are_the_default(tmp_path):
    positions = np.tile(np.arange(S, dtype=np.int64), (B, 1))
    res = run(tmp_path, layer() + [T("forward", "", "input", "position_ids", positions, module_class="Net")], layer())
    assert res.outcome == "agree" and accounted(res) == {"<model> input.position_ids": "positions"}
    res = run(tmp_path, layer() + [T("forward", "", "input", "position_ids", positions[:, ::-1].copy(),
                                     module_class="Net")], layer())
    assert res.exit_code == 3


def test_parameter_gradients_one_side_did_not_record_name_the_fix(tmp_path):
    """A MindSpore capture without ``optimizer=`` has no parameter gradients: inconclusive, with the one-line fix."""
    b = [t for t in layer() if t.phase != "param_grad"]
    res = run(tmp_path, layer(), b)
    assert res.exit_code == 3
    assert any(r.startswith("param_grad: A recorded 1 record(s), B 0") and "pass its optimizer to the capture" in r
               for r in res.reasons), res.reasons


def test_a_loss_only_one_side_recorded_names_the_fix(tmp_path):
    a = layer() + [T("loss", "loss", "loss", "value", np.array(1.5, dtype=np.float32), module_class="Loss")]
    res = run(tmp_path, a, layer())
    assert res.exit_code == 3
    assert any(r.startswith("loss: A recorded 1 record(s), B 0") and "cap.step(loss)" in r for r in res.reasons)


def _angles(base: float) -> np.ndarray:
    inv = 1.0 / base ** (np.arange(0, 4, 2) / 4)
    ang = np.outer(np.arange(S), inv)
    return np.concatenate([ang, ang], -1).astype(np.float32)                      # [S, D], rotate-half layout


def test_a_rope_angle_table_and_cos_sin_tables_are_compared_by_meaning(tmp_path):
    """megatron's rotary_pos_emb returns the angles [S, 1, 1, D]; Hugging Face's rotary_emb cos and sin [1, S, D]:
    one pair, B's tables read back as angles; another base diverges at the table."""
    a = layer() + [T("forward", "rotary_pos_emb", "output", "0", _angles(1e4).reshape(S, 1, 1, 4),
                     module_class="RotaryEmbedding")]

    def tables(base):
        return [T("forward", "model.rotary_emb", "output", "0", np.cos(_angles(base))[None], module_class="Rotary"),
                T("forward", "model.rotary_emb", "output", "1", np.sin(_angles(base))[None], module_class="Rotary")]

    res = run(tmp_path, a, layer() + tables(1e4))
    assert res.outcome == "agree" and res.exit_code == 0, res.reasons
    [row] = [r for r in res.rows if r.pair.a is not None and r.pair.a.label == "rotary_pos_emb output.0"]
    assert row.verdict == "ok" and [p.label for p in row.pair.b_records] == ["model.rotary_emb output.0",
                                                                             "model.rotary_emb output.1"]
    assert row.note.startswith("RoPE tables compared by meaning") and not accounted(res)
    res = run(tmp_path, a, layer() + tables(5e5))                                # another RoPE base: a divergence
    assert res.exit_code == 1 and res.first is not None and res.first.label_a == "rotary_pos_emb output.0"
