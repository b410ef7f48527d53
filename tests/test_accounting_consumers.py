"""Accounting by what consumes a record, and loss masks by value (``tensordiff.diff.accounting``), on real captures
of small torch models: ``tensordiff.capture`` records both sides, ``tensordiff.diff.diff`` compares them.

* the consumer rule: a forward input only one side passes is accounted for by its module's outputs when those were
  compared and agree; never when they diverged, never with the model as the consumer;
* loss masks: one of all ones masks nothing; one leaving out exactly the pad token's positions is a finding (the
  pad token named), never accounted for silently, unless the other side leaves out the same tokens;
* no accounted record's reason cites a record that is itself left unaccounted (``unaccounted_citations``, also used
  by the MindFormers runs of tests/test_megatron_vs_mindformers.py; tests/accounting_checks.py).
"""

from __future__ import annotations

import pytest
from accounting_checks import unaccounted_citations

torch = pytest.importorskip("torch")

import tensordiff  # noqa: E402
from tensordiff.diff import DiffOptions, diff  # noqa: E402

V, H, B, S = 16, 8, 2, 6


def _json_rows(res) -> list[dict]:
    return [{"step": r.step, "verdict": r.verdict, "linked": r.linked, "not_recorded": r.not_recorded,
             "a": r.pair.a.label if r.pair.a is not None else None,
             "b": r.pair.b.label if r.pair.b is not None else None,
             "accounted": r.accounted.as_dict() if r.accounted else None} for r in res.rows]


def _accounted(res) -> dict[str, tuple[str, str]]:
    return {(r.pair.a or r.pair.b).label: (r.accounted.rule, r.accounted.why) for r in res.rows
            if r.accounted is not None}


def _capture(model: torch.nn.Module, path: str, ids: torch.Tensor, **call) -> str:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tensordiff.capture(model, path, steps=1, optimizer=opt, tensors="all") as cap:
        loss = model(ids, **call)
        loss.backward()
        opt.step()
        cap.step(loss)
    return path


# ------------------------------------------------------------------------------------------------ the consumer rule
class Scaled(torch.nn.Module):
    """``proj(x)``; on B called with a ``scale`` kwarg the other side never passes (``shift``: how much of it is
    added to the output; 0 ignores it, as a kwarg kept for an API's sake)."""

    def __init__(self, shift: float = 0.0):
        super().__init__()
        self.proj = torch.nn.Linear(H, H)
        self.shift = shift

    def forward(self, x, scale=None):
        y = self.proj(x)
        return y if scale is None else y + self.shift * scale


class Layer(torch.nn.Module):
    def __init__(self, shift: float = 0.0, pass_scale: bool = False):
        super().__init__()
        self.mix = Scaled(shift)
        self.norm = torch.nn.LayerNorm(H)
        self.pass_scale = pass_scale

    def forward(self, x):
        extra = {"scale": torch.ones(B, S, H)} if self.pass_scale else {}
        return self.norm(x + self.mix(x, **extra))


class TinyLM(torch.nn.Module):
    """embed -> layer -> head -> mean cross-entropy of the next token (``loss_mask``: the masked mean); ``pad``: the
    model builds its own loss mask, ``ids != pad``, in a module (``masker``), as MindFormers' GPTModel does when
    called with labels and no loss mask."""

    def __init__(self, layer: torch.nn.Module, pad: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(V, H)
        self.layer = layer
        self.head = torch.nn.Linear(H, V)
        self.masker = Masker(pad) if pad is not None else None

    def forward(self, ids, labels, loss_mask=None):
        logits = self.head(self.layer(self.embed(ids)))
        per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none")
        if self.masker is not None:
            loss_mask = self.masker(ids)[1]
        if loss_mask is None:
            keep = (labels.reshape(-1) >= 0).float()  # cross_entropy's ignore index -100 gives 0 there
            return (per_token * keep).sum() / keep.sum()
        mask = loss_mask.reshape(-1)
        return (per_token * mask).sum() / mask.sum()


class Masker(torch.nn.Module):
    """The loss mask a model builds from its input ids: 1 where the id is not the pad token, flattened."""

    def __init__(self, pad: int):
        super().__init__()
        self.pad = pad

    def forward(self, ids):
        mask = (ids != self.pad).float()
        return mask, mask.reshape(-1).clone()


def _ids(with_pad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    stream = torch.randint(1, V, (B, S + 1), generator=g)
    if with_pad:
        stream[0, 2] = stream[1, 4] = stream[1, 5] = 0  # id 0: a pad token in the data
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def _pair(tmp_path, a: torch.nn.Module, b: torch.nn.Module, with_pad: bool = False, call_a=None, call_b=None):
    ids, labels = _ids(with_pad)
    b.load_state_dict(a.state_dict())
    pa = _capture(a, str(tmp_path / "a.h5"), ids, labels=labels, **(call_a or {}))
    pb = _capture(b, str(tmp_path / "b.h5"), ids, labels=labels, **(call_b or {}))
    return diff(pa, pb, DiffOptions(order_fallback=False))


def test_an_input_only_one_side_passes_is_accounted_by_its_modules_outputs_that_agree(tmp_path):
    res = _pair(tmp_path, TinyLM(Layer()), TinyLM(Layer(pass_scale=True)))
    assert res.outcome == "agree", res.reasons
    rule, why = _accounted(res)["layer.mix input.scale"]
    assert rule == "consumer"
    assert why == ("an input of layer.mix with no counterpart, consumed there: its outputs (layer.mix output.0) were "
                   "compared and agree")
    assert unaccounted_citations(_json_rows(res)) == []


def test_an_input_is_never_accounted_by_a_module_whose_outputs_diverged(tmp_path):
    res = _pair(tmp_path, TinyLM(Layer()), TinyLM(Layer(shift=0.5, pass_scale=True)))
    assert res.outcome == "diverged"
    assert res.first is not None and res.first.module_a == "layer.mix"
    assert "layer.mix input.scale" not in _accounted(res)
    assert unaccounted_citations(_json_rows(res)) == []


class Outer(torch.nn.Module):
    """The model itself takes the extra argument: no module but the whole model consumes it."""

    def __init__(self):
        super().__init__()
        self.lm = TinyLM(Layer())

    def forward(self, ids, labels, hint=None):
        return self.lm(ids, labels)


def test_the_model_itself_never_vouches_for_an_input_it_alone_takes(tmp_path):
    """A mapping that pairs nothing under the model (or the decoder, or a layer stack) stays inconclusive: the
    model's agreeing loss is no consumer to account its lone argument by."""
    res = _pair(tmp_path, Outer(), Outer(), call_b={"hint": torch.full((B, S), 0.5)})
    assert res.exit_code == 3, res.reasons
    assert "<model> input.hint" not in _accounted(res)


# ------------------------------------------------------------------------------------------------ loss masks
def test_a_loss_mask_of_all_ones_the_model_builds_is_accounted_by_value(tmp_path):
    """B builds its loss mask from the ids (not the pad token), A passes none: with no pad token in the data, a
    mask of all ones in both shapes it makes ([B, S] and flattened)."""
    res = _pair(tmp_path, TinyLM(Layer()), TinyLM(Layer(), pad=0))
    assert res.outcome == "agree", res.reasons
    got = _accounted(res)
    for label, shape in (("masker output.0", "2x6"), ("masker output.1", "12")):
        assert got[label] == ("loss-mask", f"a loss mask of all ones [{shape}]: every token counts, as on the other "
                                           "side, which passes none")
    assert unaccounted_citations(_json_rows(res)) == []


def test_a_loss_mask_leaving_out_the_pad_tokens_is_a_finding_never_accounted(tmp_path):
    res = _pair(tmp_path, TinyLM(Layer()), TinyLM(Layer(), pad=0), with_pad=True)
    assert res.outcome != "agree"
    masks = [r for r in res.rows if r.pair.b is not None and r.pair.b.module == "masker" and r.pair.b.kind == "output"]
    assert len(masks) == 2 and all(r.verdict == "unmatched" and r.accounted is None for r in masks)
    assert all("a pad token" in r.note for r in masks)
    assert any(f.startswith("B's masker output.0 [2x6], a loss mask, leaves out the 3 of 12 token(s) whose id in "
                            "<model> input.0 is 0: B's model takes 0 for its pad token") for f in res.findings), \
        res.findings
    assert unaccounted_citations(_json_rows(res)) == []


def test_a_loss_mask_leaving_out_what_the_other_sides_ignore_index_leaves_out_means_the_same(tmp_path):
    """Both sides' labels mark the pad tokens with the ignore index -100, A passes no loss mask, B builds one that
    leaves out the same tokens by their id: the same tokens left out, the same loss."""
    ids, labels = _ids(with_pad=True)
    labels[ids == 0] = -100
    a, b = TinyLM(Layer()), TinyLM(Layer(), pad=0)
    b.load_state_dict(a.state_dict())
    pa = _capture(a, str(tmp_path / "a.h5"), ids, labels=labels)
    pb = _capture(b, str(tmp_path / "b.h5"), ids, labels=labels)
    res = diff(pa, pb, DiffOptions(order_fallback=False))
    assert res.outcome == "agree", res.reasons
    got = _accounted(res)
    assert got["masker output.1"][0] == "loss-mask"
    assert got["masker output.1"][1] == ("a loss mask [12] leaving out the 3 of 12 tokens A's labels mark with an "
                                         "ignore index")
    assert not res.findings
