"""``tensordiff config``: a Megatron-LM argument dump against a MindFormers YAML of the same model names each planted
difference (one test per row of the table) and nothing else on the matched pair; defaults against the frameworks' own;
bad input is one line, exit 2."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re

import pytest
import yaml

from tensordiff import cli
from tensordiff.config import ROWS, TABLE, compare_settings, read_config
from tensordiff.config.table import MEGATRON_DEFAULTS, dtype_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DUMP = os.path.join(ROOT, "examples", "megatron_lm", "llama_tiny_args.log")
YAML = os.path.join(ROOT, "examples", "launchers", "llama_tiny.yaml")
MC = "model.model_config."


def plant_dump(tmp_path, edits: dict) -> str:
    """A copy of the argument dump with ``edits`` (argument -> value; '__text__': (old, new) for another line)."""
    with open(DUMP, encoding="utf-8") as fh:
        text = fh.read()
    for name, value in edits.items():
        if name == "__text__":
            assert value[0] in text
            text = text.replace(*value)
            continue
        line = "  {} {} {}".format(name, "." * (48 - len(name)), value)
        pattern = re.compile(rf"^  {name} \.+ .*$", re.M)
        if pattern.search(text):
            text = pattern.sub(line.replace("\\", r"\\"), text)
        else:
            text = text.replace("-------------------- end of arguments", line + "\n-------------------- end of arguments")
    path = tmp_path / "megatron.log"
    path.write_text(text)
    return str(path)


def plant_yaml(tmp_path, edits: dict) -> str:
    """A copy of the MindFormers YAML with ``edits`` (dotted path -> value)."""
    with open(YAML, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    for dotted, value in edits.items():
        node = doc
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_the_matched_pair_differs_in_nothing(capsys):
    assert cli.main(["config", DUMP, YAML, "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert "SAME: no setting differs in effect" in out
    diff = compare_settings(read_config(DUMP), read_config(YAML))
    assert diff.differences == [] and diff.only_a == [] and diff.only_b == []
    assert len(diff.same) >= 35  # compared, not skipped
    # the vocabulary is compared padded: NullTokenizer's 127 + 1 padded to a multiple of 128
    assert read_config(DUMP).values["vocab_rows"].value == 128


#: row -> (Megatron argument dump edits, MindFormers YAML edits) that make that row, and only it, differ.
PLANTS: dict[str, tuple[dict, dict]] = {
    "num_layers": ({"num_layers": 3}, {}),
    "hidden_size": ({}, {MC + "hidden_size": 128}),
    "ffn_hidden_size": ({"ffn_hidden_size": 256}, {}),
    "num_attention_heads": ({}, {MC + "num_heads": 8}),
    "num_query_groups": ({"num_query_groups": 4}, {}),
    "seq_length": ({}, {MC + "seq_length": 32}),
    "max_position_embeddings": ({"max_position_embeddings": 32}, {}),
    "vocab_rows": ({"__text__": ("(new size: 128)", "(new size: 256)")}, {}),
    "num_experts": ({"num_experts": 4, "moe_aux_loss_coeff": 0.05}, {}),
    "position_embedding": ({"position_embedding_type": "learned_absolute"}, {}),
    "normalization": ({"normalization": "LayerNorm"}, {}),
    "norm_epsilon": ({"norm_epsilon": 0.01}, {}),
    "apply_layernorm_1p": ({"apply_layernorm_1p": True}, {}),
    "activation": ({"swiglu": False}, {}),
    "rotary_base": ({"rotary_base": 500000}, {}),
    "rotary_percent": ({"rotary_percent": 0.5}, {}),
    "rope_scaling": ({"use_rope_scaling": True}, {}),
    "qkv_bias": ({"add_qkv_bias": True}, {}),
    "linear_bias": ({}, {MC + "attn_proj_has_bias": True}),
    "tied_embeddings": ({"untie_embeddings_and_output_weights": False}, {}),
    "hidden_dropout": ({"hidden_dropout": 0.1}, {}),
    "attention_dropout": ({}, {MC + "attention_dropout": 0.1}),
    "init_method_std": ({"load": None}, {"load_checkpoint": ""}),  # both from scratch: 0.02 against 0.01
    "params_dtype": ({"params_dtype": "torch.bfloat16", "accumulate_allreduce_grads_in_fp32": True}, {}),
    "compute_dtype": ({}, {MC + "compute_dtype": "bfloat16"}),
    "norm_dtype": ({}, {MC + "layernorm_compute_type": "bfloat16"}),
    "softmax_dtype": ({}, {MC + "softmax_compute_type": "float16"}),
    "rotary_dtype": ({}, {MC + "rotary_dtype": "bfloat16"}),
    "grad_reduce_dtype": ({"grad_reduce_in_bf16": True}, {}),
    "loss_scaling": ({}, {"runner_wrapper.scale_sense": {"type": "DynamicLossScaleUpdateCell",
                                                         "loss_scale_value": 65536, "scale_factor": 2,
                                                         "scale_window": 1000}}),
    "moe_aux_loss_coeff": ({"num_experts": 4}, {MC + "moe_config": {"expert_num": 4}}),
    "moe_z_loss_coeff": ({"num_experts": 4, "moe_aux_loss_coeff": 0.05, "moe_z_loss_coeff": 0.001},
                         {MC + "moe_config": {"expert_num": 4}}),
    "optimizer": ({"decoupled_weight_decay": False}, {}),
    "adam_beta1": ({}, {"optimizer.betas": [0.8, 0.999]}),
    "adam_beta2": ({"adam_beta2": 0.95}, {}),
    "adam_eps": ({"adam_eps": 1e-5}, {}),
    "weight_decay": ({"weight_decay": 0.1}, {}),
    "weight_decay_params": ({"weight_decay": 0.1, "apply_wd_to_qk_layernorm": True}, {"optimizer.weight_decay": 0.1}),
    "clip_grad": ({}, {"runner_wrapper.use_clip_grad": False}),
    "lr": ({"lr": 0.002}, {}),
    "lr_schedule": ({"lr_decay_style": "cosine"}, {}),
    "lr_warmup_steps": ({"lr_warmup_iters": 10}, {}),
    "lr_warmup_init": ({"lr_warmup_iters": 10, "lr_warmup_init": 1e-5}, {"lr_schedule.warmup_steps": 10}),
    "min_lr": ({"lr_decay_style": "cosine", "min_lr": 1e-5}, {"lr_schedule.type": "CosineWithWarmUpLR"}),
    "micro_batch_size": ({"micro_batch_size": 4}, {}),
    "global_batch_size": ({"global_batch_size": 4}, {}),
}


def test_every_row_has_a_planted_difference():
    assert sorted(PLANTS) == sorted(ROWS)


@pytest.mark.parametrize("key", list(PLANTS))
def test_a_planted_difference_is_named_and_nothing_else(key, tmp_path, capsys):
    dump_edits, yaml_edits = PLANTS[key]
    a, b = plant_dump(tmp_path, dump_edits), plant_yaml(tmp_path, yaml_edits)
    diff = compare_settings(read_config(a), read_config(b))
    assert [d.row.key for d in diff.differences] == [key]
    assert cli.main(["config", a, b, "--width", "250", "--json", str(tmp_path / "c.json")]) == 1
    out = capsys.readouterr().out
    assert f"DIFFER: {ROWS[key].label}" in out
    doc = json.loads((tmp_path / "c.json").read_text())
    assert [d["key"] for d in doc["differences"]] == [key] and doc["verdict"] == "differ"


def test_the_padded_vocabulary_is_compared_and_explained(tmp_path):
    """Megatron pads the tokenizer's vocabulary to a multiple of make-vocab-size-divisible-by x TP."""
    flags = tmp_path / "flags.txt"
    flags.write_text("torchrun pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 \\\n"
                     "  --tokenizer-type NullTokenizer --vocab-size 127 --make-vocab-size-divisible-by 128 "
                     "--tensor-model-parallel-size 2  # TP 2\n")
    s = read_config(str(flags))
    assert s.kind == "Megatron-LM flags"
    v = s.values["vocab_rows"]
    assert v.value == 256 and v.source == "set"
    assert "127 + 1 (NullTokenizer's eod) padded to a multiple of make-vocab-size-divisible-by 128 x TP 2" in v.origin


def test_a_flags_file_takes_megatron_lm_defaults_for_absent_flags(tmp_path):
    flags = tmp_path / "run.sh"
    flags.write_text("python pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 --swiglu "
                     "--disable-bias-linear --bf16\n")
    s = read_config(str(flags))
    assert s.values["hidden_dropout"].value == 0.1 and s.values["hidden_dropout"].source == "default"
    assert s.values["num_layers"].source == "set" and s.values["num_layers"].origin == "--num-layers"
    assert s.get("activation") == "swiglu" and s.get("linear_bias") is False and s.get("tied_embeddings") is True
    assert s.get("ffn_hidden_size") == 128  # int(8/3 x 64 / 64) x 64
    assert s.get("compute_dtype") == "bfloat16" and s.get("grad_reduce_dtype") == "float32"
    assert s.get("norm_epsilon") == 1e-5 and s.get("rotary_base") == 10000.0 and s.get("weight_decay") == 0.01


def test_a_hf_config_json_compares_the_model_and_lists_the_rest(tmp_path):
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 16, "vocab_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32", "attention_bias": False,
           "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    diff = compare_settings(read_config(str(path)), read_config(YAML))
    assert diff.differences == []
    assert "lr" in diff.only_b and "adam_beta1" in diff.only_b and diff.only_a == []


def test_dtype_names_are_one():
    assert {dtype_name(x) for x in ("bf16", "bfloat16", "mstype.bfloat16", "torch.bfloat16", "BFloat16")} == \
        {"bfloat16"}
    assert dtype_name("fp32") == dtype_name("torch.float32") == "float32"


@pytest.mark.parametrize("case", ["missing", "bad_yaml", "no_block", "folder", "not_config"])
def test_bad_input_is_one_line_exit_2(case, tmp_path, capsys):
    path = tmp_path / "x"
    if case == "bad_yaml":
        path = tmp_path / "x.yaml"
        path.write_text("model:\n  model_config: [1, 2\n")
    elif case == "no_block":
        path = tmp_path / "m.log"
        path.write_text(" [2026] iteration        1/       3 | lm loss: 4.85 |\n")
    elif case == "folder":
        path.mkdir()
    elif case == "not_config":
        path.write_text("hello\n")
    assert cli.main(["config", str(path), YAML]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"tensordiff: error: {path}"), err
    if case == "bad_yaml":
        assert "not valid YAML at line" in err
    if case == "no_block":
        assert "argument block" in err


# ------------------------------------------------------------------------------------------------ defaults
def test_megatron_defaults_are_megatron_cores():
    """The defaults of absent flags, against megatron-core's dataclasses and GPTModel (where core holds them)."""
    pytest.importorskip("megatron.core")
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    def default(cls, name):
        return {f.name: f.default for f in dataclasses.fields(cls)}[name]

    core = {
        "hidden_dropout": default(TransformerConfig, "hidden_dropout"),
        "attention_dropout": default(TransformerConfig, "attention_dropout"),
        "norm_epsilon": default(TransformerConfig, "layernorm_epsilon"),
        "init_method_std": default(TransformerConfig, "init_method_std"),
        "normalization": default(TransformerConfig, "normalization"),
        "swiglu": default(TransformerConfig, "gated_linear_unit"),
        "apply_layernorm_1p": default(TransformerConfig, "layernorm_zero_centered_gamma"),
        "moe_aux_loss_coeff": default(TransformerConfig, "moe_aux_loss_coeff"),
        "moe_z_loss_coeff": default(TransformerConfig, "moe_z_loss_coeff"),
        "adam_beta1": default(OptimizerConfig, "adam_beta1"),
        "adam_beta2": default(OptimizerConfig, "adam_beta2"),
        "adam_eps": default(OptimizerConfig, "adam_eps"),
        "weight_decay": default(OptimizerConfig, "weight_decay"),
        "clip_grad": default(OptimizerConfig, "clip_grad"),
        "initial_loss_scale": default(OptimizerConfig, "initial_loss_scale"),
        "loss_scale": default(OptimizerConfig, "loss_scale"),
        "decoupled_weight_decay": default(OptimizerConfig, "decoupled_weight_decay"),
        "apply_wd_to_qk_layernorm": default(OptimizerConfig, "apply_wd_to_qk_layernorm"),
        "accumulate_allreduce_grads_in_fp32": default(DistributedDataParallelConfig, "grad_reduce_in_fp32"),
    }
    params = inspect.signature(GPTModel.__init__).parameters
    core.update(rotary_base=params["rotary_base"].default, rotary_percent=params["rotary_percent"].default,
                use_rope_scaling=params["rope_scaling"].default,
                rope_scaling_factor=params["rope_scaling_factor"].default,
                position_embedding_type=params["position_embedding_type"].default)
    ours = {k: MEGATRON_DEFAULTS[k] for k in core}
    assert ours == core
    # the rows' Megatron defaults are the ones the readers fill in
    for row in TABLE:
        if row.megatron and row.megatron[0] in MEGATRON_DEFAULTS and not row.derived and row.megatron_default is not None:
            assert row.megatron_default == MEGATRON_DEFAULTS[row.megatron[0]], row.key


def test_mindformers_defaults_are_mindformers_own():
    """The MindFormers defaults of the rows, against the legacy LlamaConfig, AdamW, MFTrainOneStepCell, MoEConfig."""
    pytest.importorskip("mindformers")
    from mindformers.core.optim.adamw import AdamW
    from mindformers.models.llama.llama_config import LlamaConfig
    from mindformers.modules.transformer.moe import MoEConfig
    from mindformers.wrapper.wrapper import MFTrainOneStepCell

    llama = inspect.signature(LlamaConfig.__init__).parameters
    for row in TABLE:
        for path in row.mindformers:
            name = path.removeprefix(MC)
            if path.startswith(MC) and name in llama and not row.derived:
                want = llama[name].default
                got = row.mindformers_default
                assert (dtype_name(got) == dtype_name(want)) if row.compare == "dtype" else got == want, row.key
    adamw = inspect.signature(AdamW.__init__).parameters
    assert (ROWS["adam_beta1"].mindformers_default, ROWS["adam_beta2"].mindformers_default) == adamw["betas"].default
    assert ROWS["adam_eps"].mindformers_default == adamw["eps"].default
    assert ROWS["weight_decay"].mindformers_default == adamw["weight_decay"].default
    cell = inspect.signature(MFTrainOneStepCell.__init__).parameters
    assert cell["use_clip_grad"].default is False and ROWS["clip_grad"].mindformers_default == 0.0
    assert cell["scale_sense"].default == 1.0 and ROWS["loss_scaling"].mindformers_default == "none"
    moe = inspect.signature(MoEConfig.__init__).parameters
    assert ROWS["moe_aux_loss_coeff"].mindformers_default == moe["aux_loss_factor"].default
    assert ROWS["num_experts"].mindformers_default == moe["expert_num"].default
    assert llama["theta"].default == ROWS["rotary_base"].mindformers_default
    assert llama["rms_norm_eps"].default == ROWS["norm_epsilon"].mindformers_default


def test_the_page_runs_as_written_and_prints_what_it_shows(tmp_path):
    import test_docs as pages  # the docs' runner (a module: its tests are not collected again here)

    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    assert pages.run_page("docs/config.md", str(tmp_path)) == []
    assert json.loads((tmp_path / "config.json").read_text())["verdict"] == "differ"


def test_a_capture_gives_the_model_config_it_recorded_and_nothing_more(tmp_path):
    import numpy as np
    from helpers import T, write_capture

    config = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
              "num_query_groups": 2, "gated_linear_unit": True, "normalization": "RMSNorm", "layernorm_epsilon": 1e-5,
              "share_embeddings_and_output_weights": False, "add_bias_linear": False, "vocab_size": 128}
    x = np.ones((2, 2), dtype=np.float32)
    path = write_capture(str(tmp_path / "m.h5"), [[T("weights", "decoder.linear", "param", "weight", x)]],
                         model_config=json.dumps(config))
    s = read_config(path)
    assert s.kind == "capture (torch)" and all(v.source == "set" for v in s.values.values())
    assert s.get("activation") == "swiglu" and s.get("vocab_rows") == 128 and s.get("tied_embeddings") is False
    assert "hidden_dropout" not in s.values  # not recorded: not guessed
    diff = compare_settings(s, read_config(YAML))
    assert [d.row.key for d in diff.differences] == ["norm_epsilon"]  # 1e-5 recorded against the YAML's 1e-6
    assert "lr" in diff.only_b


# the same model written as MindFormers' mcore-style YAMLs are (use_legacy: False; Hugging Face's field names in
# model_config, as its Qwen3 and DeepSeek-V3 configs write them)
MCORE_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "n_kv_heads": "num_key_value_heads", "theta": "rope_theta",
               "max_position_embedding": "max_position_embeddings", "param_init_type": "params_dtype",
               "layernorm_compute_type": "layernorm_compute_dtype", "softmax_compute_type": "softmax_compute_dtype"}


def mcore_style_yaml(tmp_path, edits: dict | None = None) -> str:
    with open(YAML, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    cfg = doc["model"]["model_config"]
    doc["model"]["model_config"] = {MCORE_NAMES.get(k, k): v for k, v in cfg.items() if k != "type"}
    doc["model"]["model_config"].update({"hidden_act": "swiglu", "head_dim": 16, "initializer_range": 0.01,
                                         "add_bias_linear": False, "tie_word_embeddings": False,
                                         "hidden_dropout": 0.0, "attention_dropout": 0.0})
    doc["model"]["model_config"].update(edits or {})
    doc["use_legacy"] = False
    path = tmp_path / "qwen3_style.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_an_mcore_style_mindformers_yaml_reads_as_the_legacy_one(tmp_path):
    """No false difference from the field names: the Megatron-LM dump against the same model in MindFormers'
    current format compares as against the legacy YAML, every row read from its Hugging Face name."""
    path = mcore_style_yaml(tmp_path)
    diff = compare_settings(read_config(DUMP), read_config(path))
    assert diff.differences == [], [d.row.key for d in diff.differences]
    got = read_config(path).values
    assert (got["num_layers"].value, got["num_attention_heads"].value, got["num_query_groups"].value) == (2, 4, 2)
    assert got["rotary_base"].value == 10000.0 and got["num_layers"].origin == MC + "num_hidden_layers"
    assert got["params_dtype"].value == "float32" and got["grad_reduce_dtype"].value == "float32"


def test_an_mcore_style_yaml_names_a_real_difference_in_its_own_field_name(tmp_path):
    path = mcore_style_yaml(tmp_path, {"rope_theta": 1000000.0})
    diff = compare_settings(read_config(DUMP), read_config(path))
    assert [d.row.key for d in diff.differences] == ["rotary_base"]


def test_runs_names_the_settings_its_two_logs_differ_in(tmp_path, capsys):
    """``tensordiff runs`` on two Megatron-LM logs: besides the curves, the settings their argument blocks differ in
    (what ``tensordiff config`` says), in the output and the JSON."""
    b = plant_dump(tmp_path, {"adam_beta2": "0.95"})
    report = tmp_path / "runs.json"
    cli.main(["runs", DUMP, b, "--json", str(report), "--width", "200"])
    out = capsys.readouterr().out
    assert "The runs' settings differ in 1 that change what a run computes" in out and "Adam beta2: A 0.999, B 0.95" \
        in out
    doc = json.loads(report.read_text())
    assert [d["key"] for d in doc["settings"]["differences"]] == ["adam_beta2"]


#: the legacy field names the plants edit, by the name an mcore-style YAML gives them
MCORE_EDIT = {**MCORE_NAMES, "attn_proj_has_bias": "add_bias_linear"}


@pytest.mark.parametrize("key", list(PLANTS))
def test_a_planted_difference_in_an_mcore_style_yaml_is_named_and_nothing_else(key, tmp_path):
    """Every row's planted difference, with MindFormers' side written in the mcore-style format."""
    dump_edits, yaml_edits = PLANTS[key]
    path = mcore_style_yaml(tmp_path)
    with open(path, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    for dotted, value in yaml_edits.items():
        if dotted.startswith(MC):
            field = dotted[len(MC):]
            doc["model"]["model_config"][MCORE_EDIT.get(field, field)] = value
            continue
        node = doc
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(doc))
    diff = compare_settings(read_config(plant_dump(tmp_path, dump_edits)), read_config(str(tmp_path / "b.yaml")))
    assert [d.row.key for d in diff.differences] == [key]
