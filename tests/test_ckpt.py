"""``tensordiff ckpt``: one shared checkpoint, checked on real models.

A tiny real megatron-core GPTModel (Llama config, GQA) is converted and loaded into a real
MindFormers parallel_core GPTModel and a real legacy LlamaForCausalLM; a MindFormers-written
checkpoint goes back into the megatron model. Frameworks that are not installed skip.
"""

import io
import json
import os

import numpy as np
import pytest

from tensordiff.ckpt import ConversionTable
from tensordiff.ckpt import files as ckpt_files
from tensordiff.cli import main
from tensordiff.errors import CheckpointError, MappingError

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

LAYERS, HIDDEN, FFN, HEADS, GROUPS, VOCAB = 2, 64, 128, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
LLAMA_VARS = ["--var", f"heads={HEADS}", "--var", f"groups={GROUPS}"]


def td(*argv: str) -> int:
    """``tensordiff ckpt ARGV``."""
    return main(["ckpt", *argv])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """MindFormers writes ./output/log: work in a temporary folder."""
    path = tmp_path_factory.mktemp("ckpt")
    old = os.getcwd()
    os.chdir(path)
    yield path
    os.chdir(old)


@pytest.fixture(scope="module")
def mcore(workdir):
    """A real megatron-core GPTModel, Llama style; its state dict saved as mcore.pt and mcore.safetensors."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tensordiff.compat.megatron_cpu import init_megatron_cpu

    init_megatron_cpu(1234)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, params_dtype=torch.float32, normalization="RMSNorm",
                               gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                               bias_activation_fusion=False)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=VOCAB, max_sequence_length=64, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope")
    state = model.state_dict()
    torch.save(state, workdir / "mcore.pt")
    tensors = ckpt_files.load(str(workdir / "mcore.pt"))
    ckpt_files.save(tensors, str(workdir / "mcore.safetensors"))
    assert any(k.endswith("_extra_state") for k in state) and not any(k.endswith("_extra_state") for k in tensors)
    return model, tensors


@pytest.fixture(scope="module")
def mf(workdir):
    """Real MindFormers models: legacy LlamaForCausalLM (built first: build_mf_context(use_legacy=False) breaks
    it) and parallel_core GPTModels with untied and tied embeddings."""
    ms = pytest.importorskip("mindspore")
    pytest.importorskip("mindformers")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    from mindformers import LlamaConfig, LlamaForCausalLM
    from mindformers.core.context.build_context import MFContextOperator, build_mf_context

    ctx = MFContextOperator.get_mf_ctx_instance()
    if ctx is not None:  # made by a test module run before in this process (pytest -n): the legacy model's flag back
        ctx.set_context(use_legacy=True)
    llama = LlamaForCausalLM(LlamaConfig(batch_size=1, seq_length=16, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                                         n_kv_heads=GROUPS, vocab_size=VOCAB, intermediate_size=FFN, use_flash_attention=False,
                                         fused_rms_norm=False, use_rope_slice=True, compute_dtype="float32",
                                         layernorm_compute_type="float32", softmax_compute_type="float32",
                                         rotary_dtype="float32", param_init_type="float32"))
    build_mf_context({"use_legacy": False}).set_context(use_legacy=False)  # an earlier context keeps its values
    from mindformers.parallel_core.training_graph.base_models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from mindformers.parallel_core.training_graph.base_models.gpt.gpt_model import GPTModel
    from mindformers.parallel_core.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, seq_length=16, vocab_size=VOCAB, position_embedding_type="rope",
                               normalization="RMSNorm", gated_linear_unit=True, hidden_act="silu", add_bias_linear=False,
                               compute_dtype="float32", params_dtype="float32", layernorm_compute_dtype="float32",
                               softmax_compute_dtype="float32", rotary_dtype="float32", use_flash_attention=False,
                               hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=0)

    def gpt(tied: bool):
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                        max_sequence_length=64, position_embedding_type="rope", share_embeddings_and_output_weights=tied)

    return {"ms": ms, "llama": llama, "gpt": gpt(False), "gpt_tied": gpt(True)}


def _load_strict(ms, net, path):
    """Load a .ckpt into a real net; every parameter must be loaded and every entry used."""
    not_loaded, unused = ms.load_param_into_net(net, ms.load_checkpoint(str(path)), strict_load=True)
    assert not_loaded == [] and unused == []
    return {p.name: p.asnumpy() for p in net.get_parameters()}


def test_megatron_checkpoint_loads_into_real_mindformers_gptmodel(mcore, mf, workdir, capsys):
    _, tensors = mcore
    assert td("convert", "mcore.pt", "mf.ckpt", "--mapping", "mcore-mindformers") == 0
    out = capsys.readouterr().out
    assert "mcore → mindformers" in out and "interleave(dim=0) ×2" in out
    params = _load_strict(mf["ms"], mf["gpt"], workdir / "mf.ckpt")
    assert set(params) == set(tensors)
    for name, value in tensors.items():
        got = params[name]
        if "linear_fc1" in name:  # MLPInterleaved rows [g0, u0, g1, u1, ...] -> Megatron [gate; up]
            assert not np.array_equal(got, value)
            got = np.concatenate([got[0::2], got[1::2]])
        np.testing.assert_array_equal(got, value, err_msg=name)


def test_megatron_checkpoint_loads_into_real_legacy_llama(mcore, mf, workdir):
    _, tensors = mcore
    assert td("convert", "mcore.safetensors", "llama.ckpt", "--mapping", "mcore-mindformers-llama", *LLAMA_VARS) == 0
    params = _load_strict(mf["ms"], mf["llama"], workdir / "llama.ckpt")
    per = HEADS // GROUPS
    for i in range(LAYERS):
        qkv = tensors[f"decoder.layers.{i}.self_attention.linear_qkv.weight"].reshape(GROUPS, per + 2, HEAD_DIM, HIDDEN)
        attn = f"model.layers.{i}.attention."
        np.testing.assert_array_equal(params[attn + "wq.weight"], qkv[:, :per].reshape(HEADS * HEAD_DIM, HIDDEN))
        np.testing.assert_array_equal(params[attn + "wk.weight"], qkv[:, per].reshape(GROUPS * HEAD_DIM, HIDDEN))
        np.testing.assert_array_equal(params[attn + "wv.weight"], qkv[:, per + 1].reshape(GROUPS * HEAD_DIM, HIDDEN))
        fc1 = tensors[f"decoder.layers.{i}.mlp.linear_fc1.weight"]
        np.testing.assert_array_equal(params[f"model.layers.{i}.feed_forward.w1.weight"], fc1[:FFN])
        np.testing.assert_array_equal(params[f"model.layers.{i}.feed_forward.w3.weight"], fc1[FFN:])
        np.testing.assert_array_equal(params[attn + "wo.weight"],
                                      tensors[f"decoder.layers.{i}.self_attention.linear_proj.weight"])
    np.testing.assert_array_equal(params["model.tok_embeddings.embedding_weight"], tensors["embedding.word_embeddings.weight"])
    np.testing.assert_array_equal(params["lm_head.weight"], tensors["output_layer.weight"])


def test_mindformers_written_checkpoint_loads_back_into_megatron(mcore, mf, workdir):
    model, tensors = mcore
    ms = mf["ms"]
    td("convert", "mcore.pt", "mf.ckpt", "--mapping", "mcore-mindformers")
    _load_strict(ms, mf["gpt"], workdir / "mf.ckpt")
    ms.save_checkpoint(mf["gpt"], str(workdir / "mf_native.ckpt"))  # written by MindSpore from the net itself
    assert td("convert", "mf_native.ckpt", "back.pt", "--mapping", "mcore-mindformers") == 0
    state = torch.load(workdir / "back.pt", map_location="cpu", weights_only=True)
    result = model.load_state_dict(state, strict=False)
    assert result.unexpected_keys == [] and all(k.endswith("_extra_state") for k in result.missing_keys)
    for name, value in tensors.items():
        np.testing.assert_array_equal(state[name].numpy(), value, err_msg=name)


def test_tied_embeddings_have_no_output_layer_on_either_side(mcore, mf, workdir):
    _, tensors = mcore
    tied = {k: v for k, v in tensors.items() if k != "output_layer.weight"}
    ckpt_files.save(tied, str(workdir / "tied.safetensors"))
    assert td("convert", "tied.safetensors", "tied.ckpt", "--mapping", "mcore-mindformers", "--to", "mindformers") == 0
    params = _load_strict(mf["ms"], mf["gpt_tied"], workdir / "tied.ckpt")
    assert "output_layer.weight" not in params


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mapping,extra", [("mcore-mindformers", []), ("mcore-mindformers-llama", LLAMA_VARS)])
def test_round_trip_is_bit_exact(mcore, mf, workdir, dtype, mapping, extra):
    model, _ = mcore
    state = {k: v.to(getattr(torch, dtype)) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    torch.save(state, workdir / f"rt_{dtype}.pt")
    assert td("convert", f"rt_{dtype}.pt", f"rt_{dtype}.ckpt", "--mapping", mapping, *extra) == 0
    assert td("convert", f"rt_{dtype}.ckpt", f"rt_{dtype}_back.pt", "--mapping", mapping, *extra) == 0
    back = torch.load(workdir / f"rt_{dtype}_back.pt", map_location="cpu", weights_only=True)
    assert list(back) == list(state)
    for name, value in state.items():
        assert back[name].dtype == value.dtype, name
        raw = torch.int16 if dtype == "bfloat16" else torch.int32
        assert torch.equal(back[name].view(raw), value.view(raw)), name


def test_every_problem_is_reported_in_one_error(mcore, workdir, capsys):
    _, tensors = mcore
    bad = dict(tensors)
    gone = ["decoder.layers.0.input_layernorm.weight", "decoder.layers.1.mlp.linear_fc2.weight", "decoder.final_layernorm.weight"]
    for name in gone:
        del bad[name]
    bad["decoder.layers.7.junk.weight"] = np.zeros(3, np.float32)
    bad["decoder.layers.1.self_attention.linear_proj.weight"] = np.zeros((HIDDEN, HIDDEN - 4), np.float32)
    ckpt_files.save(bad, str(workdir / "bad.safetensors"))
    with pytest.raises(CheckpointError) as err:
        ConversionTable.load("mcore-mindformers").convert(bad, source="mcore", path="bad.safetensors")
    message = str(err.value)
    assert "bad.safetensors" in message and "3 missing, 1 unexpected, 1 mis-shaped" in message
    for name in gone + ["decoder.layers.7.junk.weight", "decoder.layers.1.self_attention.linear_proj.weight"]:
        assert name in message
    assert "[64, 60]" in message and "fix:" in message and "\n" not in message

    assert td("convert", "bad.safetensors", "bad.ckpt", "--mapping", "mcore-mindformers", "--to", "mindformers") == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tensordiff: error: bad.safetensors")
    assert all(name in lines[0] for name in gone) and not (workdir / "bad.ckpt").exists()


def test_a_missing_variable_is_named_with_an_example(mcore, capsys):
    with pytest.raises(MappingError, match=r"needs --var groups=N .*example: tensordiff ckpt convert"):
        ConversionTable.load("mcore-mindformers-llama", {"heads": "4"})
    assert td("convert", "mcore.pt", "x.ckpt", "--mapping", "mcore-mindformers-llama", "--var", "heads=4") == 2
    assert "--var groups=N" in capsys.readouterr().err
    # a wrong head count is caught as a shape problem, not silently mis-split
    assert td("convert", "mcore.pt", "x.ckpt", "--mapping", "mcore-mindformers-llama", "--var", "heads=8",
              "--var", "groups=2") == 2
    assert "heads+2*groups" in capsys.readouterr().err


def test_diff_converted_checkpoint_is_identical_then_names_a_perturbed_tensor(mcore, mf, workdir, capsys):
    _, tensors = mcore
    td("convert", "mcore.pt", "mf.ckpt", "--mapping", "mcore-mindformers")
    td("convert", "mcore.pt", "llama.ckpt", "--mapping", "mcore-mindformers-llama", *LLAMA_VARS)
    capsys.readouterr()
    assert td("diff", "mcore.pt", "mf.ckpt", "--width", "80", "--max-rows", "0", "--json", "same.json") == 0
    out = capsys.readouterr().out
    assert out.count("identical") >= len(tensors) and "DIFFERS" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    report = json.loads((workdir / "same.json").read_text())
    assert report["passed"] and {r["verdict"] for r in report["rows"]} == {"identical"}
    assert len(report["rows"]) == len(tensors)

    assert td("diff", "mcore.pt", "llama.ckpt", *LLAMA_VARS, "--width", "80") == 0  # 1:N split back to linear_qkv
    assert "{wq,wk,wv}" in capsys.readouterr().out

    victim = "decoder.layers.1.mlp.linear_fc2.weight"
    changed = ckpt_files.load(str(workdir / "mf.ckpt"))
    changed[victim] = changed[victim].copy()
    changed[victim][3, 5] += 1e-3
    ckpt_files.save(changed, str(workdir / "mf_changed.ckpt"))
    assert td("diff", "mcore.pt", "mf_changed.ckpt", "--mapping", "mcore-mindformers", "--width", "80",
              "--json", "changed.json") == 1
    out = capsys.readouterr().out
    assert "DIFFERS" in out and "Different: decoder.layers.1.mlp.linear_fc2.weight" in out
    rows = json.loads((workdir / "changed.json").read_text())["rows"]
    assert [r["name"] for r in rows if r["verdict"] != "identical"] == [victim]


def test_diff_flags_a_layout_variable_that_does_not_match(mcore, mf, workdir, capsys):
    td("convert", "mcore.pt", "stacked.ckpt", "--mapping", "mcore-mindformers", "--var", "fc1_layout=stacked")
    capsys.readouterr()
    assert td("diff", "mcore.pt", "stacked.ckpt", "--json", "stacked.json") == 1
    assert "DIFFERS" in capsys.readouterr().out
    notes = {r["name"]: r["note"] for r in json.loads((workdir / "stacked.json").read_text())["rows"] if r["note"]}
    assert sorted(notes) == [f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(LAYERS)]
    assert all("equals B without deinterleave(dim=0): check --var fc1_layout" in n for n in notes.values())
    assert td("diff", "mcore.pt", "stacked.ckpt", "--var", "fc1_layout=stacked") == 0


def leave_mark(path):
    """What a pickled object of the test below would call if anything of the file were run."""
    with open(path, "w") as f:
        f.write("ran")


class NotATensor:
    def __init__(self, mark):
        self.mark = mark

    def __reduce__(self):  # rebuilt by calling leave_mark(path): a name the safe reader must keep inert
        return (leave_mark, (self.mark,))


def test_other_pickled_objects_are_read_as_inert_stand_ins_never_run(mcore, workdir, capsys):
    mark = workdir / "ran"
    torch.save({"embedding.word_embeddings.weight": torch.ones(2), "config": NotATensor(str(mark))},
               workdir / "pickle.pt")
    tensors, skipped = ckpt_files.load_with_skipped(str(workdir / "pickle.pt"))
    assert list(tensors) == ["embedding.word_embeddings.weight"] and skipped == {"config": "leave_mark"}
    from tensordiff.frameworks import torch_safe

    inert = torch_safe.load(str(workdir / "pickle.pt"))["config"]
    assert isinstance(inert, torch_safe.Opaque) and inert.opaque_name == "test_ckpt.leave_mark"
    assert inert.args == (str(mark),) and not mark.exists()  # named, kept, never called


def _megatron_lm_file(path, iteration=1500):
    """What Megatron-LM's --save writes per rank (--ckpt-format torch): the model, the run's args (a Namespace with
    torch dtypes and megatron enums), the optimizer's and scheduler's state, Python's, numpy's and torch's RNG states.
    Returns (model, optimizer)."""
    import argparse
    import random

    from megatron.core.transformer.enums import AttnBackend

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    args = argparse.Namespace(lr=1e-3, params_dtype=torch.bfloat16, attention_backend=AttnBackend.flash,
                              num_layers=2, data_path=None, adam_beta1=0.9)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                "model": {"layer.weight": model.weight.detach(), "layer.bias": model.bias.detach(),
                          "layer._extra_state": None},
                "optimizer": {"optimizer": opt.state_dict(), "fp32_from_fp16_params": []},
                "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": 3000},
                "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                               "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}],
                "num_floating_point_operations_so_far": 12345}, path)
    return model, opt


def test_a_megatron_lm_model_optim_rng_file_is_read_safely(workdir):
    import argparse

    from megatron.core.transformer.enums import AttnBackend

    from tensordiff.frameworks import torch_safe

    model, opt = _megatron_lm_file(workdir / "model_optim_rng.pt")
    tensors, skipped = ckpt_files.load_with_skipped(str(workdir / "model_optim_rng.pt"))
    assert sorted(tensors) == ["layer.bias", "layer.weight"] and skipped == {"layer._extra_state": "NoneType"}
    assert np.array_equal(tensors["layer.weight"], model.weight.detach().numpy())
    whole = torch_safe.load(str(workdir / "model_optim_rng.pt"))
    assert whole["iteration"] == 1500 and whole["args"].params_dtype is torch.bfloat16
    # megatron's enum: itself where megatron-core allow-lists it (importing it does), else an inert stand-in
    backend = whole["args"].attention_backend
    assert isinstance(whole["args"], argparse.Namespace) and (backend is AttnBackend.flash or (
        isinstance(backend, torch_safe.Opaque) and backend.args == (1,)))
    state = whole["optimizer"]["optimizer"]["state"][0]
    assert torch.equal(state["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]) and float(state["step"]) == 1.0
    np_state = whole["rng_state"][0]["np_rng_state"]
    assert np_state[0] == "MT19937" and np.array_equal(np_state[1], np.random.get_state()[1])
    assert whole["rng_state"][0]["random_rng_state"][0] == 3


@pytest.mark.parametrize("name,content,expected", [
    ("absent.pt", None, "no such file"),
    ("truncated.pt", b"PK\x03\x04 not really a zip", "not a readable torch checkpoint"),
    ("garbage.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json", "not a readable safetensors file"),
    ("weights.bin", b"", "unknown checkpoint format '.bin'; supported: .safetensors"),
])
def test_unreadable_files_give_one_line(workdir, name, content, expected, capsys):
    if content is not None:
        (workdir / name).write_bytes(content)
    assert td("convert", name, "x.ckpt", "--mapping", "mcore-mindformers") == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1


def test_corrupt_mindspore_checkpoint(mf, workdir):
    (workdir / "corrupt.ckpt").write_bytes(b"garbage" * 10)
    with pytest.raises(CheckpointError, match="not a readable MindSpore checkpoint"):
        ckpt_files.load(str(workdir / "corrupt.ckpt"))


def test_megatron_nested_model_dict_is_accepted_and_other_dicts_are_described(workdir):
    torch.save({"iteration": 3, "checkpoint_version": 3.0, "model": {"w": torch.arange(4, dtype=torch.bfloat16)}},
               workdir / "nested.pt")
    loaded = ckpt_files.load(str(workdir / "nested.pt"))
    assert list(loaded) == ["w"] and loaded["w"].dtype.name == "bfloat16"
    assert loaded["w"].view(np.uint16).tolist() == torch.arange(4, dtype=torch.bfloat16).view(torch.int16).tolist()
    torch.save({"iteration": 3, "optimizer": {"lr": 1.0}}, workdir / "no_model.pt")
    with pytest.raises(CheckpointError, match=r"'iteration': int.*no 'model' state dict"):
        ckpt_files.load(str(workdir / "no_model.pt"))


def test_report_renders_without_colour_at_80_columns(mcore):
    from tensordiff.ckpt import CheckpointDiff, diff_tensors
    from tensordiff.report.ckpt import CkptDiffReport
    from tensordiff.report.theme import make_console

    _, tensors = mcore
    other = dict(tensors)
    other["embedding.word_embeddings.weight"] = tensors["embedding.word_embeddings.weight"].astype(np.float16)
    rows = diff_tensors(tensors, other)
    buf = io.StringIO()
    make_console(file=buf, width=80, color=False).print(CkptDiffReport(CheckpointDiff("a.pt", "b.pt", rows)))
    text = buf.getvalue()
    assert "\x1b[" not in text and max(len(line) for line in text.splitlines()) <= 80
    assert "f32/f16" in text and " ok" in text


def test_a_megatron_lm_save_folder_reads_the_iteration_its_tracker_names(workdir, capsys):
    save = workdir / "save"
    for it in (1000, 1500):
        (save / f"iter_{it:07d}" / "mp_rank_00").mkdir(parents=True)
        _megatron_lm_file(save / f"iter_{it:07d}" / "mp_rank_00" / "model_optim_rng.pt", it)
    (save / "latest_checkpointed_iteration.txt").write_text("1500")
    picked = ckpt_files.megatron_dir_file(str(save))
    assert picked == str(save / "iter_0001500")
    assert ckpt_files.megatron_dir_file(str(save / "iter_0001000")) == str(save / "iter_0001000")
    # the model, and Adam's moments per parameter (one param group: the model's order)
    loaded = ckpt_files.load(str(save))
    assert sorted(loaded) == ["layer.bias", "layer.weight", "optimizer.exp_avg.layer.bias",
                              "optimizer.exp_avg.layer.weight", "optimizer.exp_avg_sq.layer.bias",
                              "optimizer.exp_avg_sq.layer.weight"]
    assert td("diff", str(save), str(save / "iter_0001500")) == 0


@pytest.mark.parametrize("layout, says", [
    ({"latest_checkpointed_iteration.txt": "200"}, "names 200, but"),
    ({"latest_checkpointed_iteration.txt": "best"}, "not an iteration number or 'release'"),
    ({"iter_0000002/mp_rank_00/model_optim_rng.pt": None, "iter_0000002/mp_rank_02/model_optim_rng.pt": None,
      "latest_checkpointed_iteration.txt": "2"}, "mp_rank_01 missing of the 3 x 1 (TP x PP) rank folders"),
    ({"iter_0000002/.metadata": "", "iter_0000002/__0_0.distcp": "", "latest_checkpointed_iteration.txt": "2"},
     "no common.pt"),
    ({"iter_0000002/mp_rank_00/other.pt": None, "latest_checkpointed_iteration.txt": "2"},
     "no model_optim_rng.pt (holds other.pt)"),
    ({"iter_0000002/mp_rank_00/model_optim_rng.pt": None}, "pass one of its iteration folders (iter_0000002)"),
])
def test_a_bad_or_partial_save_folder_is_one_line_naming_what_is_missing(workdir, capsys, layout, says):
    save = workdir / "bad_save"
    if save.exists():
        import shutil

        shutil.rmtree(save)
    for name, text in layout.items():
        (save / name).parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            _megatron_lm_file(save / name)
        else:
            (save / name).write_text(text)
    assert td("diff", str(save), str(save)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "Traceback" not in err[0], err
