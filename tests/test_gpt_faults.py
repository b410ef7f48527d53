"""End to end on real megatron-core GPTModel and HF transformers GPT-2 (CPU, FP32)."""

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from examples.gpt import train
from tensordiff.diff import DiffOptions, diff
from tensordiff.explain.place import explanation
from tensordiff.mapping import RenameRules


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Captures by name, made on demand; 'ref' is the plain megatron-core run that saves its checkpoint."""
    folder = tmp_path_factory.mktemp("gpt")
    made = {}

    def get(name, *extra):
        if name not in made:
            path = str(folder / f"{name}.h5")
            args = ["--capture", path, "--train-steps", "2", "--capture-steps", "2", *extra]
            if name == "ref":
                args += ["--save-ckpt", str(folder / "ckpt.safetensors")]
            made[name] = (path, train.main(args))
        return made[name][0]

    get("ref")
    get.folder = folder
    return get


FAULTS = [
    # fault, step, phase, module named, words in the location
    ("ln-eps", 0, "forward", "decoder.layers.1.pre_mlp_layernorm", "in decoder.layers.1.pre_mlp_layernorm"),
    ("gelu-tanh", 0, "forward", "decoder.layers.1.mlp.linear_fc2", "inside decoder.layers.1.mlp between linear_fc1 and "
                                                                   "linear_fc2"),
    ("gelu-backward", 0, "backward", "decoder.layers.1.mlp.linear_fc1",
     "in the backward of code inside decoder.layers.1.mlp between linear_fc1 and linear_fc2"),
    ("ckpt", 0, "weights", "decoder.layers.0.self_attention.linear_qkv", "before the first step"),
    ("grad-scale", 0, "param_grad", "decoder.layers.1.mlp.linear_fc2", "weight gradient of "
                                                                       "decoder.layers.1.mlp.linear_fc2.weight"),
    ("optimizer-wd", 1, "weights", "decoder.layers.0.input_layernorm", "optimizer update"),
]


@pytest.mark.parametrize("fault,step,phase,module,location", FAULTS, ids=[f[0] for f in FAULTS])
def test_injected_fault_is_found_at_its_place(runs, fault, step, phase, module, location):
    result = diff(runs("ref"), runs(fault, "--fault", fault))
    first = result.first
    assert first is not None
    assert (first.step, first.phase, first.module_a) == (step, phase, module)
    assert first.introduced
    assert location in first.location


def test_checkpoint_fault_names_the_parameter(runs):
    first = diff(runs("ref"), runs("ckpt", "--fault", "ckpt")).first
    assert first.slot == "weight" and first.kind == "param"


def test_same_model_reloaded_from_checkpoint_agrees(runs):
    ckpt = str(runs.folder / "ckpt.safetensors")
    result = diff(runs("ref"), runs("reloaded", "--load-ckpt", ckpt, "--seed", "99"))
    assert result.first is None
    assert result.count("diverged") == 0 and result.count("unmatched") == 0
    assert result.count("ok") > 300


def test_without_the_checkpoint_the_weights_differ(runs):
    first = diff(runs("ref"), runs("seed99", "--seed", "99")).first
    assert (first.step, first.phase, first.module_a) == (0, "weights", "embedding.word_embeddings")


def test_fused_vs_split_qkv_is_not_a_divergence(runs):
    """Three q/k/v matmuls instead of one: linear_qkv's output is bit for bit the same on the CPU (same-stack
    exactness, which judges forward outputs, finds nothing), its input gradient differs by rounding only."""
    result = diff(runs("ref"), runs("split", "--fault", "split-qkv"))
    assert result.first is None
    assert result.count("diverged") == 0
    assert result.exact.startswith("torch") and "bitwise identical" in result.exact


def test_megatron_vs_hf_gpt2_diverges_inside_the_first_mlp(runs):
    mapping = RenameRules.load("mcore-hf-gpt2", {"heads": "4"})
    result = diff(runs("ref"), runs("hf", "--framework", "hf"), DiffOptions(mapping=mapping))
    first = result.first
    assert first is not None
    assert (first.step, first.phase) == (0, "forward")
    assert first.module_a == "decoder.layers.0.mlp.linear_fc2"
    assert first.module_b == "transformer.h.0.mlp.c_proj"
    assert first.location == "inside decoder.layers.0.mlp between linear_fc1 and linear_fc2"
    # nothing earlier: every matched row before it agrees, and the attention was compared at all
    first_seq = next(r.pair.a.seq for r in result.rows
                     if r.step == 0 and r.phase == "forward" and r.pair.a is not None and r.pair.a.label == first.label_a)
    earlier = [r for r in result.rows if r.step == 0 and r.pair.matched
               and (r.phase == "weights" or (r.phase == "forward" and r.pair.a.seq < first_seq))]
    assert len(earlier) > 30 and all(r.verdict == "ok" for r in earlier)
    assert any(r.pair.a.module.endswith("self_attention.linear_qkv") and r.pair.a.kind == "output" for r in earlier)
    assert result.count("shape") == 0


def test_megatron_vs_hf_gpt2_with_the_same_gelu_agrees(runs, tmp_path):
    """With HF's activation set to megatron's erf GELU, the frameworks agree within FP32 noise."""

    import tensordiff
    from examples.gpt.models import GPTSpec, build_hf_gpt2, build_mcore_gpt, hf_loss, make_batch

    spec = GPTSpec()
    mcore = build_mcore_gpt(spec, seed=1234)
    hf = build_hf_gpt2(spec, mcore.state_dict(), activation="gelu")
    opt = train.optimizer_for(hf, "none", 1e-3)
    path = str(tmp_path / "hf_erf.h5")
    with tensordiff.capture(hf, path, steps=2, optimizer=opt) as cap:
        for step in range(2):
            tokens, labels, _ = make_batch(spec, seed=step)
            loss = hf_loss(hf, tokens, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            cap.step(loss)
    result = diff(runs("ref"), path, DiffOptions(mapping=RenameRules.load("mcore-hf-gpt2", {"heads": "4"})))
    assert result.first is None, result.first and explanation(result.first)
    assert result.count("ok") > 150
