"""A forward argument that is a parameter of the model is recorded as that parameter: a link (``same_as``) to the
step's weights record of it, by tensor identity or storage (never by name); the capture changes no number and leaves
no hook behind."""

import torch

import tensordiff
from tensordiff.store import CaptureFile


class Head(torch.nn.Module):
    """A linear layer that takes its weight as an argument, as megatron's ColumnParallelLinear does (``weight=``)."""

    def forward(self, x, weight):
        return x @ weight.t()


class Tied(torch.nn.Module):
    """Tied embeddings passed on in three ways: the parameter itself (as a keyword), an untracked alias of its storage
    (``detach()``), and a differentiable view (a computed tensor in autograd's eyes, recorded as itself)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.emb = torch.nn.Embedding(16, 8)
        self.head = Head()

    def forward(self, ids):
        w = self.emb.weight
        arg = {"param": w, "alias": w.detach(), "view": w.view(16, 8)}[self.how]
        return self.head(self.emb(ids), weight=arg)


def _train(model, steps, cap=None):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(torch.randint(0, 16, (2, 5))).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if cap is not None:
            cap.step(loss)
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _records(path, step):
    with CaptureFile(path) as cap:
        recs = cap.records(step)
    return {r.seq: r for r in recs}, {r.label: r for r in recs}


def test_a_parameter_or_an_alias_of_its_storage_is_a_link_to_its_weights_record(tmp_path):
    for how in ("param", "alias"):
        path = str(tmp_path / f"{how}.h5")
        torch.manual_seed(1)
        plain, captured = Tied(how), Tied(how)
        captured.load_state_dict(plain.state_dict())
        bare = _train(plain, 3)
        with tensordiff.capture(captured, path, steps=2, tensors="all") as cap:
            seen = _train(captured, 3, cap)
        assert bare[0] == seen[0] and all(torch.equal(a, b) for a, b in zip(bare[1], seen[1]))  # bit for bit
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in captured.modules())
        for step in (0, 1):  # every step links to that step's weights (the parameter changed in between)
            by_seq, by_label = _records(path, step)
            arg = by_label["head input.weight"]
            assert arg.same_as >= 0 and by_seq[arg.same_as].label == "emb weight", how
            assert (arg.shape, arg.l2, arg.has_data) == (by_label["emb weight"].shape, by_label["emb weight"].l2, True)
        with CaptureFile(path) as c:  # read through the link: the parameter's values at that step
            assert (c.array(_records(path, 1)[1]["head input.weight"]) == c.array(_records(path, 1)[1]["emb weight"])
                    ).all()


def test_a_differentiable_view_of_a_parameter_is_recorded_as_itself_with_its_gradient(tmp_path):
    path = str(tmp_path / "view.h5")
    with tensordiff.capture(Tied("view"), path, steps=1) as cap:
        _train(cap.model, 1, cap)
    _, by_label = _records(path, 0)
    arg = by_label["head input.weight"]
    assert arg.same_as < 0
    assert by_label["head grad_input.weight"].grad_of == arg.seq  # its gradient hooked, as before
