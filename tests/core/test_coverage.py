"""Never a silent pass: coverage per phase, uncertain pairs, and the inconclusive outcome (exit 3).

Synthetic captures of a two-layer model, recorded as the capture hooks record it::

    Net ('')        ids -> emb -> fc -> y,  loss = mean(y**2) / 2
      Embedding ('emb')   int64 ids -> rows of E
      Linear ('fc')       h @ W
"""

from __future__ import annotations

import numpy as np
from helpers import T, write_capture

from tensordiff.cli import main
from tensordiff.diff import DiffOptions, RenameRules, diff
from tensordiff.explain.place import explanation

RNG = np.random.default_rng(1)
IDS = np.array([[1, 3, 2, 0]], dtype=np.int64)
E = RNG.standard_normal((4, 6)).astype(np.float32)
W = RNG.standard_normal((6, 3)).astype(np.float32)
LINK = {"has_data": 1}


def values(ids=IDS, emb=E, w=W, loss_scale=1.0):
    h = emb[ids]
    y = (h @ w).astype(np.float32)
    loss = np.array(0.5 * np.mean(y.astype(np.float64) ** 2), dtype=np.float32)
    dy = (loss_scale * y / y.size).astype(np.float32)
    dh = (dy @ w.T).astype(np.float32)
    return {"ids": ids, "E": emb, "W": w, "h": h, "y": y, "loss": loss, "dy": dy, "dh": dh,
            "dW": (h.reshape(-1, 6).T @ dy.reshape(-1, 3)).astype(np.float32)}


def records(v, fc_name="fc", fc_class="Linear", y_shape=None, backward=True):
    y = v["y"] if y_shape is None else np.zeros(y_shape, dtype=np.float32)
    recs = [T("weights", "emb", "param", "weight", v["E"], module_class="Embedding"),
            T("weights", fc_name, "param", "weight", v["W"], module_class=fc_class),
            T("forward", "", "input", "0", v["ids"], enter=2, module_class="Net"),                          # 2
            T("forward", "emb", "input", "0", v["ids"], same_as=2, enter=3, module_class="Embedding", extra=LINK),
            T("forward", "emb", "output", "0", v["h"], enter=3, module_class="Embedding"),                  # 4
            T("forward", fc_name, "input", "0", v["h"], same_as=4, enter=5, module_class=fc_class, extra=LINK),
            T("forward", fc_name, "output", "0", y, enter=5, module_class=fc_class),                        # 6
            T("forward", "", "output", "0", y, same_as=6, enter=2, module_class="Net", extra=LINK),
            T("loss", "loss", "loss", "value", v["loss"], module_class="Loss")]
    if backward:
        recs += [T("backward", fc_name, "grad_output", "0", v["dy"], grad_of=6, enter=5, module_class=fc_class),
                 T("backward", fc_name, "grad_input", "0", v["dh"], grad_of=5, enter=5, module_class=fc_class),
                 T("param_grad", fc_name, "grad", "weight", v["dW"], module_class=fc_class)]
    return recs


def capture(tmp_path, name, recs, framework="torch"):
    return write_capture(str(tmp_path / f"{name}.h5"), [recs], framework=framework)


def test_a_clean_pair_agrees_with_every_phase_fully_compared(tmp_path):
    a = capture(tmp_path, "a", records(values()))
    b = capture(tmp_path, "b", records(values()))
    res = diff(a, b)
    assert (res.outcome, res.exit_code, res.reasons) == ("agree", 0, [])
    assert list(res.coverage) == ["weights", "forward", "loss", "backward", "param_grad"]
    fwd = res.coverage["forward"]
    assert (fwd.recorded_a, fwd.recorded_b, fwd.compared, fwd.share_a) == (6, 6, 6, 1.0)


def test_a_shape_skipped_pair_is_inconclusive_not_a_pass(tmp_path, capsys):
    a = capture(tmp_path, "a", records(values()))
    b = capture(tmp_path, "b", records(values(), y_shape=(1, 4, 5)))  # B's fc output has another shape
    res = diff(a, b)
    assert res.first is None and res.outcome == "inconclusive" and res.exit_code == 3
    assert any(r.startswith("forward: 2 pair(s) found but not compared") for r in res.reasons), res.reasons
    assert main(["diff", a, b, "--width", "80"]) == 3
    out = capsys.readouterr().out
    assert "Inconclusive: no divergence among the pairs compared" in out and "No divergence:" not in out


def test_a_record_with_no_counterpart_makes_it_inconclusive(tmp_path):
    v = values()
    extra = [T("forward", "post", "input", "0", v["y"], same_as=6, enter=9, module_class="Tanh", extra=LINK),
             T("forward", "post", "output", "0", np.tanh(v["y"]), enter=9, module_class="Tanh")]
    a_recs = records(v)
    a = capture(tmp_path, "a", a_recs[:9] + extra + a_recs[9:])  # A has a module B does not
    b = capture(tmp_path, "b", records(v))
    res = diff(a, b)
    fwd = res.coverage["forward"]
    # post's input is fc's output again (compared there); its output has no counterpart anywhere
    assert (fwd.recorded_a, fwd.compared_a, fwd.linked_a, fwd.only_a) == (8, 7, 1, 1)
    assert res.outcome == "inconclusive" and res.exit_code == 3
    assert res.reasons == ["1 of A's and 0 of B's records have no counterpart and are not accounted for (the 'only "
                           "in' lines); a mapping gives them one, or ignores them on purpose (its ignore: list)"]
    ignore = RenameRules.from_text("rules: []\nignore_a: ['post']\n")
    res = diff(a, b, DiffOptions(mapping=ignore))  # ignored on purpose: accounted for
    assert res.outcome == "agree" and res.exit_code == 0


def test_a_tensor_recorded_twice_counts_as_compared_where_it_was(tmp_path):
    a = capture(tmp_path, "a", records(values()))
    b = capture(tmp_path, "b", records(values(), fc_name="proj", fc_class="Dense"))  # another name, no mapping
    res = diff(a, b, DiffOptions(order_fallback=False))
    fwd = res.coverage["forward"]
    # fc's input is emb's output, fc's output is the model's output: both compared under those names
    assert (fwd.compared, fwd.compared_a, fwd.linked_a, fwd.only_a) == (4, 6, 2, 0)


def test_a_pair_made_only_by_order_across_other_names_and_classes_is_uncertain_not_the_divergence(tmp_path):
    a = capture(tmp_path, "a", records(values()))
    other = values(w=W * 1.5)  # B's last layer differs, and B names and types it differently
    b = capture(tmp_path, "b", records(other, fc_name="proj", fc_class="Dense"))
    res = diff(a, b)
    by_label = {(r.pair.a.label if r.pair.a else None): r for r in res.rows}
    row = by_label["fc output.0"]
    assert row.pair.how == "order" and row.verdict == "uncertain"
    assert "paired by order and shape only: A's fc (Linear) vs B's proj (Dense)" in row.note
    assert res.first is None or res.first.module_a != "fc"
    assert res.outcome != "agree"


def test_integer_inputs_that_differ_are_a_batch_problem(tmp_path):
    a = capture(tmp_path, "a", records(values()))
    b = capture(tmp_path, "b", records(values(ids=np.array([[1, 3, 2, 1]], dtype=np.int64))))
    first = diff(a, b).first
    assert (first.phase, first.kind, first.module_a) == ("forward", "input", "")
    assert first.location == "in the inputs the runs were fed"
    assert "The runs were fed different inputs: <model> input.0 (int64) differs" in explanation(first)


def test_a_loss_reduced_differently_is_named_the_loss(tmp_path):
    a = capture(tmp_path, "a", records(values()))
    b = capture(tmp_path, "b", records(values(loss_scale=12.0)))  # sum instead of mean over 12 elements
    first = diff(a, b).first
    assert (first.phase, first.module_a, first.kind) == ("backward", "fc", "grad_output")
    assert first.location == "in the loss's gradient (its reduction, scaling or labels)"
    assert "the loss is reduced differently (mean vs sum" in explanation(first)


def test_an_input_that_was_never_compared_is_not_called_agreeing(tmp_path):
    v = values()
    a_recs = records(v)
    b_recs = records(v, backward=False)
    # B's fc input has another shape (never compared) and its output differs
    b_recs[5] = T("forward", "fc", "input", "0", np.zeros((1, 4, 7), dtype=np.float32), enter=5, module_class="Linear")
    b_recs[6] = T("forward", "fc", "output", "0", v["y"] * 1.5, enter=5, module_class="Linear")
    a = capture(tmp_path, "a", a_recs)
    b = capture(tmp_path, "b", b_recs)
    first = diff(a, b).first
    assert first.module_a == "fc" and first.kind == "output"
    assert first.uncompared == ["fc input.0"]
    assert "Not compared, so not known to agree: 1 of the records that came in (fc input.0)" in explanation(first)
    assert "agree where they were compared" in explanation(first)
    assert "The inputs of fc (Linear) agree and" not in explanation(first)


def test_a_phase_one_side_did_not_record_is_inconclusive(tmp_path):
    a = capture(tmp_path, "a", records(values()))
    b = capture(tmp_path, "b", records(values(), backward=False))
    res = diff(a, b)
    assert res.outcome == "inconclusive"
    assert "backward: A recorded 2 record(s), B 0, and no pair was compared (B did not record this phase)" in res.reasons


def test_arguments_of_other_names_paired_by_order_are_uncertain(tmp_path):
    v = values()
    positions = np.arange(4, dtype=np.int64).reshape(1, 4)
    a_recs = records(v)
    b_recs = records(v)
    # A's model also takes position ids, B's takes labels instead: same kind and shape, other values
    a_recs.insert(3, T("forward", "", "input", "position_ids", positions, enter=2, module_class="Net"))
    b_recs.insert(3, T("forward", "", "input", "labels", IDS[:, ::-1].copy(), enter=2, module_class="Net"))
    for recs in (a_recs, b_recs):  # the links after the insertion point move by one
        for t in recs[4:]:
            t.same_as += 1 if t.same_as >= 3 else 0
            t.grad_of += 1 if t.grad_of >= 3 else 0
            t.enter += 1 if t.enter >= 3 else 0
    res = diff(capture(tmp_path, "a", a_recs), capture(tmp_path, "b", b_recs))
    row = next(r for r in res.rows if r.pair.a is not None and r.pair.a.slot == "position_ids")
    assert row.pair.how == "order" and row.pair.b.slot == "labels" and row.verdict == "uncertain"
    assert "A's argument input.position_ids of <model> vs B's input.labels of <model>" in row.note
    assert res.first is None and res.outcome == "inconclusive"


def _graph_pair(tmp_path, b_attrs):
    """A: the hooks' records, where emb's output tensor (fc's input) has its gradient recorded first, as emb's
    grad_output. B: the same model with the lookup done by plain ops (no emb cell call), captured in graph mode:
    the tensor is only fc's input there, and gradients of inputs are never recorded."""
    v = values()
    a_recs = records(v, backward=False) + [
        T("backward", "fc", "grad_output", "0", v["dy"], grad_of=6, enter=5, module_class="Linear"),
        T("backward", "emb", "grad_output", "0", v["dh"], grad_of=4, enter=3, module_class="Embedding"),
        T("param_grad", "fc", "grad", "weight", v["dW"], module_class="Linear")]
    b_recs = [T("weights", "emb", "param", "weight", v["E"], module_class="Embedding"),
              T("weights", "fc", "param", "weight", v["W"], module_class="Linear"),
              T("forward", "", "input", "0", v["ids"], enter=2, module_class="Net"),                         # 2
              T("forward", "fc", "input", "0", v["h"], enter=3, module_class="Linear"),                      # 3
              T("forward", "fc", "output", "0", v["y"], enter=3, module_class="Linear"),                     # 4
              T("forward", "", "output", "0", v["y"], same_as=4, enter=2, module_class="Net", extra=LINK),
              T("loss", "loss", "loss", "value", v["loss"], module_class="Loss"),
              T("backward", "fc", "grad_output", "0", v["dy"], grad_of=4, enter=3, module_class="Linear"),
              T("param_grad", "fc", "grad", "weight", v["dW"], module_class="Linear")]
    a = capture(tmp_path, "a", a_recs)
    b = write_capture(str(tmp_path / "b.h5"), [b_recs], framework="mindspore", **b_attrs)
    return a, b


def test_a_gradient_whose_tensor_the_graph_side_holds_only_as_an_input_is_accounted_for(tmp_path):
    a, b = _graph_pair(tmp_path, {"capture_mode": "graph", "not_recorded": "grad_input"})
    res = diff(a, b)
    bwd = res.coverage["backward"]
    assert (bwd.recorded_a, bwd.compared_a, bwd.not_recorded_a, bwd.only_a) == (2, 1, 1, 0)
    assert (res.outcome, res.exit_code) == ("agree", 0)
    row = next(r for r in res.rows if r.pair.a is not None and r.pair.a.module == "emb" and r.phase == "backward")
    assert row.not_recorded and not row.linked


def test_the_same_gradient_is_only_in_a_when_the_other_side_records_input_gradients(tmp_path):
    a, b = _graph_pair(tmp_path, {})  # B could have recorded it (as fc's grad_input) and did not: not a pass
    res = diff(a, b)
    bwd = res.coverage["backward"]
    assert (bwd.not_recorded_a, bwd.only_a) == (0, 1)
    assert (res.outcome, res.exit_code) == ("inconclusive", 3)


def test_the_json_summary_counts_only_in_b_as_the_text_does(tmp_path, capsys):
    """A record of B with no counterpart whose tensor was compared under another of B's names (the model's output,
    which is fc's output) is not 'only in B': the text and the JSON's summary say the same 0, and say the link."""
    import json

    recs = records(values())
    a = capture(tmp_path, "a", [r for r in recs if not (r.module == "" and r.kind == "output")])
    b = capture(tmp_path, "b", recs)
    report = tmp_path / "r.json"
    assert main(["diff", a, b, "--json", str(report)]) == 0
    out = capsys.readouterr().out
    summary = json.loads(report.read_text())["summary"]
    assert "0 only in A, 0 only in B (1 more recorded again under another name" in " ".join(out.split())
    assert (summary["only_a"], summary["only_b"], summary["linked_a"], summary["linked_b"]) == (0, 0, 0, 1)


def test_first_divergence_with_none_shows_the_rows_behind_an_inconclusive_reason(tmp_path, capsys):
    a = capture(tmp_path, "a", records(values()))
    b = capture(tmp_path, "b", records(values(), y_shape=(1, 4, 5)))  # B's fc output has another shape: SHAPE rows
    assert main(["diff", a, b, "--first-divergence", "--width", "80"]) == 3
    out = capsys.readouterr().out
    assert "step 0 · forward" in out and "SHAPE" in out.upper() and "step 0 · weights" not in out
    assert main(["diff", a, b, "--first-divergence", "--max-rows", "0", "--width", "80"]) == 3
    assert "step 0 · weights" in capsys.readouterr().out              # --max-rows 0: every table
    same = capture(tmp_path, "c", records(values()))
    assert main(["diff", a, same, "--first-divergence", "--width", "80"]) == 0
    assert "step 0 ·" not in capsys.readouterr().out                  # agree: nothing to list
