"""Pipeline-parallel stage files joined on read (tensordiff.store.pipeline), on synthetic captures of a two-layer
model (y = x @ W_i.T per layer), as megatron-core records them: each stage numbers its layers from 0 and says its
``layer_offset``; stage 0's model output is the hidden state it hands to stage 1 (a link to its last layer's
output), stage 1 receives it as its first layer's input.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import T, write_capture

from tensordiff.errors import CaptureFileError
from tensordiff.store import PipelineCapture, open_capture

RNG = np.random.default_rng(7)
W = [RNG.standard_normal((3, 3)).astype(np.float32) for _ in range(2)]
X = RNG.standard_normal((2, 4, 3)).astype(np.float32)  # [S, B, H]
IDS = np.arange(8, dtype=np.int64).reshape(4, 2)
Y0 = X @ W[0].T
Y1 = Y0 @ W[1].T
G1 = np.ones_like(Y1) / Y1.size
G0 = G1 @ W[1]


def stage0(ids=IDS):
    return [T("weights", "decoder.layers.0", "param", "weight", W[0], module_class="Linear"),            # 0
            T("forward", "", "input", "0", ids, module_class="GPT", enter=1),                            # 1
            T("forward", "decoder", "input", "hidden_states", X, module_class="Block", enter=2),         # 2
            T("forward", "decoder.layers.0", "input", "hidden_states", X, module_class="Linear", same_as=2,
              enter=3, parent="decoder"),                                                                # 3
            T("forward", "decoder.layers.0", "output", "0", Y0, module_class="Linear", enter=3,
              parent="decoder"),                                                                         # 4
            T("forward", "decoder", "output", "0", Y0, module_class="Block", same_as=4, enter=2),         # 5
            T("forward", "", "output", "0", Y0, module_class="GPT", same_as=4, enter=1),                 # 6
            T("backward", "decoder.layers.0", "grad_output", "0", G0, module_class="Linear", grad_of=4, enter=3,
              parent="decoder"),                                                                         # 7
            T("param_grad", "decoder.layers.0", "grad", "weight", G0.reshape(-1, 3).T @ X.reshape(-1, 3),
              module_class="Linear")]                                                                    # 8


def stage1(ids=IDS, w=W[1], received=Y0):
    return [T("weights", "decoder.layers.0", "param", "weight", w, module_class="Linear"),               # 0
            T("forward", "", "input", "0", ids, module_class="GPT", enter=1),                            # 1
            T("forward", "decoder.layers.0", "input", "hidden_states", received, module_class="Linear", enter=2,
              parent="decoder"),                                                                         # 2
            T("forward", "decoder.layers.0", "output", "0", Y1, module_class="Linear", enter=2,
              parent="decoder"),                                                                         # 3
            T("forward", "decoder", "output", "0", Y1, module_class="Block", same_as=3, enter=2),          # 4
            T("forward", "", "output", "0", Y1, module_class="GPT", same_as=3, enter=1),                 # 5
            T("backward", "decoder.layers.0", "grad_output", "0", G1, module_class="Linear", grad_of=3, enter=2,
              parent="decoder"),                                                                         # 6
            T("param_grad", "decoder.layers.0", "grad", "weight", G1.reshape(-1, 3).T @ Y0.reshape(-1, 3),
              module_class="Linear"),                                                                    # 7
            T("loss", "loss", "loss", "value", np.float32(0.5), module_class="Loss")]                    # 8


def write_stages(tmp_path, name="pp", offsets=(0, 1), drop=(), tp=(1, 1), dp=1, **kw):
    stages = [stage0(kw.get("ids0", IDS)), stage1(kw.get("ids1", IDS), kw.get("w1", W[1]), kw.get("received", Y0))]
    if kw.get("two_layers_on_stage0"):  # stage 0 holds layers 0 and 1, yet stage 1 says its first layer is 1
        for t in stages[0]:  # every link past the new row moves down one
            t.same_as, t.grad_of, t.enter = (v + 1 if v >= 1 else v for v in (t.same_as, t.grad_of, t.enter))
        stages[0].insert(1, T("weights", "decoder.layers.1", "param", "weight", W[1], module_class="Linear"))
    world = sum(tp) * dp
    rank = 0
    for k, recs in enumerate(stages):
        for t, d in [(t, d) for d in range(dp) for t in range(tp[k])]:
            coords = {"world_size": world, "rank": rank, "tp": tp[k], "tp_rank": t, "dp": dp, "dp_rank": d, "pp": 2,
                      "pp_rank": k, "source": "megatron.core.parallel_state"}
            if offsets[k] is not None:
                coords["layer_offset"] = offsets[k]
            if rank not in drop:
                write_capture(str(tmp_path / f"{name}.rank{rank}.h5"), [recs], parallel=json.dumps(coords))
            rank += 1
    return str(tmp_path / f"{name}.rank*.h5")


def test_stages_join_in_the_single_device_order_with_global_layer_numbers(tmp_path):
    with open_capture(write_stages(tmp_path)) as cap:
        assert isinstance(cap, PipelineCapture) and (cap.pp, cap.tp, cap.dp, cap.offsets) == (2, 1, 1, [0, 1])
        recs = cap.records(0)
        assert [(r.phase, r.module, r.kind, r.slot) for r in recs] == [
            ("weights", "decoder.layers.0", "param", "weight"),
            ("weights", "decoder.layers.1", "param", "weight"),
            ("forward", "", "input", "0"),
            ("forward", "decoder", "input", "hidden_states"),
            ("forward", "decoder.layers.0", "input", "hidden_states"),
            ("forward", "decoder.layers.0", "output", "0"),
            ("forward", "decoder.layers.1", "input", "hidden_states"),  # what stage 1 received
            ("forward", "decoder.layers.1", "output", "0"),
            ("forward", "decoder", "output", "0"),  # the last stage's: stage 0's is the handed-over hidden state
            ("forward", "", "output", "0"),
            ("backward", "decoder.layers.1", "grad_output", "0"),  # backward: the last stage first
            ("backward", "decoder.layers.0", "grad_output", "0"),
            ("param_grad", "decoder.layers.0", "grad", "weight"),
            ("param_grad", "decoder.layers.1", "grad", "weight"),
            ("loss", "loss", "loss", "value")]
        assert [r.seq for r in recs] == list(range(len(recs)))
        by = {(r.phase, r.module, r.kind): r for r in recs}
        out1, root_out = by[("forward", "decoder.layers.1", "output")], by[("forward", "", "output")]
        assert root_out.same_as == out1.seq and by[("forward", "decoder", "output")].same_as == out1.seq
        assert root_out.enter == by[("forward", "", "input")].seq  # the model's call enters on stage 0
        assert by[("backward", "decoder.layers.1", "grad_output")].grad_of == out1.seq
        assert by[("forward", "decoder.layers.1", "input")].parent == "decoder"
        np.testing.assert_array_equal(cap.array(by[("weights", "decoder.layers.1", "param")]), W[1])
        np.testing.assert_array_equal(cap.array(root_out), Y1)
        sent, sender, receiver = cap.received_from(by[("forward", "decoder.layers.1", "input")])
        assert (sent.module, sent.kind, sender, receiver) == ("decoder.layers.0", "output", 0, 1)
        assert cap.step_attrs(0)["records"] == len(recs) and cap.inconsistencies(0) == []
        assert json.loads(cap.attrs["merged_from"]) == {"files": 2, "tp": 1, "dp": 1, "pp": 2}


def test_a_replicated_input_that_differs_between_stages_is_a_cross_rank_inconsistency(tmp_path):
    with open_capture(write_stages(tmp_path, ids1=IDS + 1)) as cap:
        assert cap.inconsistencies(0) == ["<model> input.0: PP ranks 0/1 differ"]


@pytest.mark.parametrize("kw,message", [
    ({"offsets": (0, None)}, r"pp\.rank1\.h5: pipeline stage 1 without its layer offset"),
    ({"two_layers_on_stage0": True}, r"pipeline stages 0 and 1 both hold decoder\.layers\.1 \(step 0\) once their "
                                     r"layers are numbered globally \(layer offsets \[0, 1\]\)"),
    ({"offsets": (0, 0)}, r"layer offsets \[0, 0\] do not increase stage by stage"),
    ({"tp": (2, 2), "drop": (3,)}, r"a run of 4 ranks needs one file per rank; missing rank\(s\) \[3\]"),
    ({"tp": (2, 1)}, r"pipeline stages of different TP x DP sizes \(1 x 1, 2 x 1\) are not merged"),
    # data parallel: stage 1 fed only the mask (as Megatron-LM feeds middle stages): its batch shards are unknown
    ({"dp": 2, "ids1": np.zeros((1, 1, 2, 2), bool)}, r"pipeline stage 1 records no model input of stage 0's local "
                                                      r"batch \(1 vs 4\)"),
])
def test_what_cannot_be_joined_is_one_error_never_a_silent_merge(tmp_path, kw, message):
    with pytest.raises(CaptureFileError, match=message):
        open_capture(write_stages(tmp_path, **kw)).records(0)


def single_device():
    """The two layers on one device, as the recorder writes them: layer 1's input is a link to layer 0's output."""
    return [T("weights", "decoder.layers.0", "param", "weight", W[0], module_class="Linear"),            # 0
            T("weights", "decoder.layers.1", "param", "weight", W[1], module_class="Linear"),            # 1
            T("forward", "", "input", "0", IDS, module_class="GPT", enter=2),                            # 2
            T("forward", "decoder", "input", "hidden_states", X, module_class="Block", enter=3),         # 3
            T("forward", "decoder.layers.0", "input", "hidden_states", X, module_class="Linear", same_as=3,
              enter=4, parent="decoder"),                                                                # 4
            T("forward", "decoder.layers.0", "output", "0", Y0, module_class="Linear", enter=4,
              parent="decoder"),                                                                         # 5
            T("forward", "decoder.layers.1", "input", "hidden_states", Y0, module_class="Linear", same_as=5,
              enter=6, parent="decoder"),                                                                # 6
            T("forward", "decoder.layers.1", "output", "0", Y1, module_class="Linear", enter=6,
              parent="decoder"),                                                                         # 7
            T("forward", "decoder", "output", "0", Y1, module_class="Block", same_as=7, enter=3),         # 8
            T("forward", "", "output", "0", Y1, module_class="GPT", same_as=7, enter=2),                 # 9
            T("backward", "decoder.layers.1", "grad_output", "0", G1, module_class="Linear", grad_of=7, enter=6,
              parent="decoder"),                                                                         # 10
            T("backward", "decoder.layers.0", "grad_output", "0", G0, module_class="Linear", grad_of=5, enter=4,
              parent="decoder"),                                                                         # 11
            T("param_grad", "decoder.layers.0", "grad", "weight", G0.reshape(-1, 3).T @ X.reshape(-1, 3),
              module_class="Linear"),                                                                    # 12
            T("param_grad", "decoder.layers.1", "grad", "weight", G1.reshape(-1, 3).T @ Y0.reshape(-1, 3),
              module_class="Linear"),                                                                    # 13
            T("loss", "loss", "loss", "value", np.float32(0.5), module_class="Loss")]                    # 14


def test_stage_files_of_a_clean_run_diff_clean_against_the_single_device_run(tmp_path):
    from tensordiff.explain import diagnose

    ref = write_capture(str(tmp_path / "ref.h5"), [single_device()])
    res = diagnose(ref, write_stages(tmp_path))
    assert res.first is None and res.outcome == "agree"
    assert all(c.only_a == c.only_b == 0 for c in res.coverage.values())


def test_a_hidden_state_received_batch_first_is_a_pp_boundary_hint_at_the_receiving_layer(tmp_path):
    from tensordiff.explain import diagnose

    ref = write_capture(str(tmp_path / "ref.h5"), [single_device()])
    batch_first = np.ascontiguousarray(np.swapaxes(Y0, 0, 1)).reshape(Y0.shape)  # [B, S, H] bytes as [S, B, H]
    res = diagnose(ref, write_stages(tmp_path, received=batch_first))
    assert (res.first.phase, res.first.module_a, res.first.slot) == ("forward", "decoder.layers.1", "hidden_states")
    assert res.first.location == "between decoder.layers.0 and decoder.layers.1"
    top = res.hints[0]
    assert top.cause == "pp-boundary" and top.explained > 0.99 and top.title.endswith("(batch first)")
    assert top.details["arrival"].startswith("batch first") and top.details["sender_stage"] == 0
    zeros = diagnose(ref, write_stages(tmp_path, name="zeros", received=np.zeros_like(Y0))).hints[0]
    assert zeros.cause == "pp-boundary" and zeros.title.endswith("(zeros)")
