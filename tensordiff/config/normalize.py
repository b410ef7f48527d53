"""Each framework's settings as the table's canonical keys: names looked up, defaults filled in, units and dtype names
made one, and the derived rows (padded vocabulary, activation, dtypes, loss scaling, schedule) computed."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from .settings import Settings
from .table import MEGATRON_DEFAULTS, MINDFORMERS_LR_STYLES, ROWS, TABLE, dtype_name

Derived = tuple[Any, tuple[str, ...], str]
"""(value, the inputs it came from, a note on how) of a derived row; value None: not known."""


def _num(value: Any) -> Any:
    """'1e-6' -> 1e-06; other values as they are."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _g(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _typed(key: str, value: Any) -> Any:
    row = ROWS[key]
    if row.compare == "dtype":
        return dtype_name(value) or (str(value) if value is not None else None)
    if row.compare == "float":
        value = _num(value)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    return value


# ------------------------------------------------------------------------------------------------ Megatron-LM
class _Args:
    def __init__(self, args: dict[str, Any], set_keys: set[str] | None, defaults: bool, flags: bool):
        self.args, self.set_keys, self.defaults, self.flags = args, set_keys, defaults, flags

    def is_set(self, name: str) -> bool:
        return name in self.args and (self.set_keys is None or name in self.set_keys)

    def get(self, name: str) -> Any:
        if name in self.args and (self.set_keys is None or name in self.set_keys or name not in MEGATRON_DEFAULTS):
            return self.args[name]
        return MEGATRON_DEFAULTS.get(name) if self.defaults else None

    def name(self, name: str) -> str:
        return f"--{name.replace('_', '-')}" if self.flags else name


def _m_dtype(a: _Args) -> str:
    params = dtype_name(a.args.get("params_dtype")) if "params_dtype" in a.args else None
    if params:
        return params
    return "bfloat16" if a.get("bf16") else "float16" if a.get("fp16") else "float32"


def _m_compute(a: _Args) -> str:
    """The activations' dtype: mixed precision by --bf16 / --fp16, else the parameters' dtype."""
    if a.get("bf16"):
        return "bfloat16"
    if a.get("fp16"):
        return "float16"
    return "float32" if a.defaults or a.is_set("bf16") else _m_dtype(a)


def _m_ffn(a: _Args) -> Derived:
    ffn, hidden = a.get("ffn_hidden_size"), a.get("hidden_size")
    if ffn is not None or not isinstance(hidden, int):
        return ffn, ("ffn_hidden_size",), ""
    if a.get("swiglu"):
        return int((4 * hidden * 2 / 3) / 64) * 64, ("hidden_size", "swiglu"), "int(8/3 x hidden / 64) x 64 (SwiGLU)"
    return 4 * hidden, ("hidden_size",), "4 x hidden"


def _m_groups(a: _Args) -> Derived:
    if a.get("group_query_attention"):
        return a.get("num_query_groups"), ("num_query_groups",), ""
    return a.get("num_attention_heads"), ("num_attention_heads",), "no GQA: one group per head"


def _m_vocab(a: _Args) -> Derived:
    padded = a.args.get("padded_vocab_size")
    if isinstance(padded, int):
        return padded, ("padded_vocab_size",), "Megatron-LM's padded vocabulary"
    vocab = a.get("vocab_size")
    if not isinstance(vocab, int):
        return None, (), ""
    tokenizer = str(a.get("tokenizer_type") or "")
    size, why = vocab, f"--vocab-size {vocab}"
    if tokenizer == "NullTokenizer":
        size, why = vocab + 1, f"{vocab} + 1 (NullTokenizer's eod)"
    multiple = int(a.get("make_vocab_size_divisible_by") or 1) * int(a.get("tensor_model_parallel_size") or 1)
    padded = math.ceil(size / multiple) * multiple
    return padded, ("vocab_size", "make_vocab_size_divisible_by", "tensor_model_parallel_size"), \
        (f"{why} padded to a multiple of make-vocab-size-divisible-by {a.get('make_vocab_size_divisible_by')} x TP "
         f"{a.get('tensor_model_parallel_size')}")


#: Activation functions under their many names (Hugging Face hidden_act, megatron's function names) -> one name.
_ACT_NAMES = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu-tanh", "gelu_new": "gelu-tanh",
              "gelu_fast": "gelu-tanh", "gelu_tanh": "gelu-tanh", "fast_gelu": "gelu-tanh", "gelu": "gelu",
              "gelu_impl": "gelu", "openai_gelu": "gelu-tanh", "relu2": "squared-relu", "squared_relu": "squared-relu",
              "relu": "relu"}


def _m_activation(a: _Args) -> Derived:
    used = ("swiglu", "squared_relu")
    func = str(a.get("activation_func") or "").lower()
    if func in _ACT_NAMES:  # a capture records megatron-core's activation function by name
        name = _ACT_NAMES[func]
        return ("swiglu" if name == "silu" and a.get("swiglu") else name), ("activation_func", "gated_linear_unit"), \
            "gated" if a.get("swiglu") and name != "silu" else ""
    if a.get("swiglu"):
        return "swiglu", used, ""
    if a.get("squared_relu"):
        return "squared-relu", used, ""
    if not a.defaults and not a.is_set("swiglu"):
        return None, (), ""
    return "gelu", used, ""


def _m_rope_scaling(a: _Args) -> Derived:
    used = ("use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor")
    if a.get("use_rope_scaling"):
        return f"llama3 x{_g(a.get('rope_scaling_factor'))}", used, ""
    factor = a.get("rotary_seq_len_interpolation_factor")
    if factor not in (None, 1, 1.0):
        return f"linear x{_g(factor)}", used, ""
    return "none", used, ""


def _m_loss_scaling(a: _Args) -> Derived:
    used = ("fp16", "loss_scale", "initial_loss_scale")
    if not a.get("fp16"):
        return "none", used, "no --fp16: no loss scaling"
    if a.get("loss_scale") is not None:
        return f"static {_g(a.get('loss_scale'))}", used, ""
    return f"dynamic from {_g(a.get('initial_loss_scale'))}", used, ""


def _m_grad_reduce(a: _Args) -> Derived:
    used = ("accumulate_allreduce_grads_in_fp32", "grad_reduce_in_bf16", "bf16")
    fp32 = a.get("accumulate_allreduce_grads_in_fp32")
    if a.get("grad_reduce_in_bf16"):
        return "bfloat16", used, "--grad-reduce-in-bf16"
    if not fp32 and a.flags and a.get("bf16") and not a.get("grad_reduce_in_bf16"):
        return "float32", used, "--bf16 without --grad-reduce-in-bf16 sets --accumulate-allreduce-grads-in-fp32"
    return ("float32" if fp32 else _m_dtype(a)), used, ""


def _m_warmup(a: _Args) -> Derived:
    fraction = a.get("lr_warmup_fraction")
    if fraction is not None:
        total = a.get("lr_decay_iters") or a.get("train_iters")
        if not isinstance(total, int):
            return None, (), ""
        return round(fraction * total), ("lr_warmup_fraction", "lr_decay_iters", "train_iters"), \
            f"{_g(fraction)} x {total} steps"
    return a.get("lr_warmup_iters"), ("lr_warmup_iters",), ""


def _m_global_batch(a: _Args) -> Derived:
    gbs = a.get("global_batch_size")
    if gbs is not None:
        return gbs, ("global_batch_size",), ""
    mbs, dp = a.get("micro_batch_size"), a.args.get("data_parallel_size")
    if isinstance(mbs, int) and isinstance(dp, int):
        return mbs * dp, ("micro_batch_size", "data_parallel_size"), "micro-batch x data-parallel size"
    return None, (), ""


def _m_optimizer(a: _Args) -> Derived:
    name = str(a.get("optimizer"))
    if name == "adam":
        return ("adamw" if a.get("decoupled_weight_decay") else "adam"), ("optimizer", "decoupled_weight_decay"), ""
    return name, ("optimizer",), ""


MEGATRON_DERIVED: dict[str, Callable[[_Args], Derived]] = {
    "ffn_hidden_size": _m_ffn,
    "num_query_groups": _m_groups,
    "max_position_embeddings": lambda a: (a.get("max_position_embeddings") or a.get("seq_length"),
                                          ("max_position_embeddings", "seq_length"), ""),
    "vocab_rows": _m_vocab,
    "num_experts": lambda a: (a.get("num_experts") or (1 if a.defaults else None), ("num_experts",), ""),
    "activation": _m_activation,
    "rope_scaling": _m_rope_scaling,
    "qkv_bias": lambda a: (bool(a.get("add_qkv_bias") or a.get("add_bias_linear")), ("add_qkv_bias", "add_bias_linear"),
                           ""),
    "linear_bias": lambda a: (bool(a.get("add_bias_linear")), ("add_bias_linear",), ""),
    "tied_embeddings": lambda a: (not a.get("untie_embeddings_and_output_weights"),
                                  ("untie_embeddings_and_output_weights",), ""),
    "params_dtype": lambda a: (_m_dtype(a), ("params_dtype", "bf16", "fp16"), ""),
    "compute_dtype": lambda a: (_m_compute(a), ("bf16", "fp16"), ""),
    "norm_dtype": lambda a: ("float32", (), "Megatron's norms compute in float32"),
    "softmax_dtype": lambda a: ("float32" if a.get("attention_softmax_in_fp32") or _m_compute(a) == "float32"
                                else _m_compute(a), ("attention_softmax_in_fp32", "bf16", "fp16"), ""),
    "rotary_dtype": lambda a: (_m_compute(a), ("bf16", "fp16"), "the activations' dtype"),
    "grad_reduce_dtype": _m_grad_reduce,
    "loss_scaling": _m_loss_scaling,
    "moe_z_loss_coeff": lambda a: (a.get("moe_z_loss_coeff") or (0.0 if a.defaults else None), ("moe_z_loss_coeff",),
                                   ""),
    "optimizer": _m_optimizer,
    "weight_decay_params": lambda a: ("matrices and q/k norm weights (not biases, not other 1-D weights)"
                                      if a.get("apply_wd_to_qk_layernorm") else ROWS["weight_decay_params"]
                                      .megatron_default, ("apply_wd_to_qk_layernorm",), ""),
    "lr_warmup_steps": _m_warmup,
    "global_batch_size": _m_global_batch,
}


def megatron_settings(args: dict[str, Any], path: str, kind: str, *, set_keys: set[str] | None,
                      defaults: bool = True) -> Settings:
    """Megatron-LM arguments (``args.NAME``) as settings. ``set_keys``: the names the input gave (a flags file), None
    when every argument is there (a log's dump, a checkpoint). ``defaults``: fill absent arguments with Megatron-LM's."""
    a = _Args(args, set_keys, defaults, flags=kind.endswith("flags"))
    out = Settings(path, kind, "megatron")
    for row in TABLE:
        derive = MEGATRON_DERIVED.get(row.key)
        if not defaults and not any(n in args for n in row.megatron):
            continue
        if derive is not None:
            value, used, note = derive(a)
            source = "set" if any(a.is_set(n) for n in used) else "default"
            where = ", ".join(a.name(n) for n in used if a.is_set(n)) or "defaults"
            origin = where + (f" ({note})" if note else "") if source == "set" else \
                ("default" + (f": {note}" if note else f" of {', '.join(a.name(n) for n in used)}"))
        else:
            name = next((n for n in row.megatron if a.is_set(n) or (n in args and set_keys is None)), row.megatron[0])
            value = a.get(name)
            source = "set" if a.is_set(name) else "default"
            origin = a.name(name) if source == "set" else f"default of {a.name(name)}"
        out.put(row.key, _typed(row.key, value), source, origin)
    out.context["loads_checkpoint"] = bool(a.get("load") or args.get("pretrained_checkpoint"))
    out.unread = len([k for k in args if k not in MEGATRON_DEFAULTS])
    return out


# ------------------------------------------------------------------------------------------------ MindFormers
def _path(doc: Any, dotted: str) -> tuple[bool, Any]:
    node = doc
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


class _Yaml:
    def __init__(self, doc: dict[str, Any], defaults: bool):
        self.doc, self.defaults = doc, defaults

    def find(self, *paths: str) -> tuple[str | None, Any]:
        for path in paths:
            ok, value = _path(self.doc, path)
            if ok and value is not None and value != "None":
                return path, value
        return None, None

    def value(self, path: str, default: Any) -> Any:
        found, value = self.find(path)
        return value if found else default


MC = "model.model_config."


def _f_ffn(y: _Yaml) -> Derived:
    path, value = y.find(MC + "intermediate_size")
    if path:
        return value, (path,), ""
    hidden = y.value(MC + "hidden_size", 4096)
    multiple, mult = y.value(MC + "multiple_of", 256), y.value(MC + "ffn_dim_multiplier", None)
    dim = int(2 * 4 * hidden / 3)
    if mult is not None:
        dim = int(mult * dim)
    dim = multiple * ((dim + multiple - 1) // multiple)
    return dim, (MC + "hidden_size", MC + "multiple_of"), "int(8/3 x hidden) up to a multiple of multiple_of"


def _f_activation(y: _Yaml) -> Derived:
    path, act = y.find(MC + "hidden_act")
    if not path:
        return "swiglu", (), "MindFormers' Llama MLP is SwiGLU"
    name = str(act).lower()
    gated = y.value(MC + "gated_linear_unit", True)
    if name in ("silu", "swiglu", "swish", "llamasilu"):
        return ("swiglu" if gated else "silu"), (path,), ""
    return name, (path,), ""


def _f_rope_scaling(y: _Yaml) -> Derived:
    path, method = y.find(MC + "extend_method")
    _, factor = y.find(MC + "scaling_factor")
    if isinstance(factor, dict):
        factor = factor.get("factor")
    if not path or str(method) in ("None", "none", ""):
        return "none", tuple(p for p in (path,) if p), ""
    kind = {"PI": "linear", "linear": "linear", "LLAMA3": "llama3", "NTK": "ntk", "YARN": "yarn",
            "DYNAMIC_NTK": "dynamic-ntk"}.get(str(method), str(method).lower())
    return f"{kind} x{_g(factor if factor is not None else 1.0)}", (path, MC + "scaling_factor"), ""


def _f_loss_scaling(y: _Yaml) -> Derived:
    path, sense = y.find("runner_wrapper.scale_sense")
    if not path:
        return "none", (), "MFTrainOneStepCell's scale_sense 1.0"
    if isinstance(sense, (int, float)):
        return ("none" if float(sense) == 1.0 else f"static {_g(sense)}"), (path,), ""
    if isinstance(sense, dict):
        kind, value = str(sense.get("type", "")), sense.get("loss_scale_value", 1.0)
        if "Dynamic" in kind:
            return f"dynamic from {_g(value)}", (path,), ""
        return ("none" if float(value) == 1.0 else f"static {_g(value)}"), (path,), ""
    return str(sense), (path,), ""


def _f_clip(y: _Yaml) -> Derived:
    use_path, use = y.find("runner_wrapper.use_clip_grad")
    norm_path, norm = y.find("runner_wrapper.max_grad_norm")
    used = tuple(p for p in (use_path, norm_path) if p)
    if not use:
        return 0.0, used, "" if use_path else "MFTrainOneStepCell's use_clip_grad False"
    return float(norm if norm is not None else 1.0), used, ""


def _f_optimizer(y: _Yaml) -> Derived:
    path, kind = y.find("optimizer.type")
    if not path:
        return None, (), ""
    name = str(kind)
    return ("adamw" if name.endswith("AdamW") else name.lower()), (path,), ""


def _f_beta(index: int) -> Callable[[_Yaml], Derived]:
    def beta(y: _Yaml) -> Derived:
        path, betas = y.find("optimizer.betas")
        if path and isinstance(betas, (list, tuple)) and len(betas) > index:
            return betas[index], (path,), ""
        return (0.9, 0.999)[index], (), ""
    return beta


def _f_lr(y: _Yaml) -> Derived:
    path, lr = y.find("lr_schedule.learning_rate", "lr_schedule.base_lr", "optimizer.learning_rate")
    if isinstance(lr, dict):  # optimizer.learning_rate may be a schedule
        path, lr = (path + ".learning_rate", lr.get("learning_rate")) if path else (path, None)
    return lr, tuple(p for p in (path,) if p), ""


def _f_schedule(y: _Yaml) -> Derived:
    path, kind = y.find("lr_schedule.type", "optimizer.learning_rate.type")
    if path:
        return MINDFORMERS_LR_STYLES.get(str(kind), str(kind)), (path,), ""
    lr_path, lr = y.find("optimizer.learning_rate")
    if lr_path and isinstance(lr, (int, float)):
        return "constant", (lr_path,), "a fixed learning rate"
    return None, (), ""


def _f_warmup(y: _Yaml) -> Derived:
    path, steps = y.find("lr_schedule.warmup_steps")
    if path:
        return int(steps), (path,), ""
    rpath, ratio = y.find("lr_schedule.warmup_ratio")
    tpath, total = y.find("lr_schedule.total_steps")
    if rpath and isinstance(total, int) and total > 0:
        return round(float(ratio) * total), (rpath, tpath or ""), f"{_g(ratio)} x {total} steps"
    return 0, (), ""


def _f_min_lr(y: _Yaml) -> Derived:
    path, value = y.find("lr_schedule.lr_end", "lr_schedule.min_lr", "lr_schedule.eta_min")
    if path:
        return value, (path,), ""
    return 0.0, (), ""


def _f_global_batch(y: _Yaml) -> Derived:
    mpath, mbs = y.find("runner_config.batch_size", MC + "batch_size")
    if not mpath:
        return None, (), ""
    parallel = bool(y.value("use_parallel", False))
    dp = int(y.value("parallel_config.data_parallel", 1)) if parallel else 1
    ga = int(y.value("runner_config.gradient_accumulation_steps", 1))
    pp = int(y.value("parallel_config.pipeline_stage", 1)) if parallel else 1
    mbn = int(y.value("parallel_config.micro_batch_num", 1)) if pp > 1 else 1
    used = (mpath,) + tuple(p for p in ("runner_config.gradient_accumulation_steps", "parallel_config.data_parallel",
                                        "parallel_config.micro_batch_num") if y.find(p)[0])
    return int(mbs) * dp * ga * mbn, used, \
        f"batch_size {mbs} x data_parallel {dp} x gradient_accumulation_steps {ga}" + (f" x micro_batch_num {mbn}"
                                                                                      if mbn > 1 else "")


def _or(y: _Yaml, paths: tuple[str, ...], default: Any, note: str) -> Derived:
    """The first of ``paths`` the YAML holds, else ``default`` (a fact of MindFormers' code, or its default)."""
    path, value = y.find(*paths)
    return (value, (path,), "") if path else (default, (), note)


MINDFORMERS_DERIVED: dict[str, Callable[[_Yaml], Derived]] = {
    "ffn_hidden_size": _f_ffn,
    "num_query_groups": lambda y: _or(y, (MC + "n_kv_heads",), y.value(MC + "num_heads", 32),
                                      "n_kv_heads absent: one per head"),
    "max_position_embeddings": lambda y: _or(y, (MC + "max_position_embedding", MC + "max_position_embeddings"),
                                             y.value(MC + "seq_length", 2048), "the sequence length"),
    "num_experts": lambda y: _or(y, (MC + "moe_config.expert_num", "moe_config.expert_num", MC + "num_moe_experts"),
                                 1, ""),
    "position_embedding": lambda y: _or(y, (MC + "position_embedding_type",), "rope", "MindFormers' Llama: RoPE"),
    "normalization": lambda y: _or(y, (MC + "normalization",), "RMSNorm", "MindFormers' Llama: RMSNorm"),
    "activation": _f_activation,
    "rope_scaling": _f_rope_scaling,
    "loss_scaling": _f_loss_scaling,
    "clip_grad": _f_clip,
    "optimizer": _f_optimizer,
    "adam_beta1": _f_beta(0),
    "adam_beta2": _f_beta(1),
    "lr": _f_lr,
    "lr_schedule": _f_schedule,
    "lr_warmup_steps": _f_warmup,
    "min_lr": _f_min_lr,
    "global_batch_size": _f_global_batch,
}


#: MindFormers' mcore-style models (``use_legacy: False``: Qwen3, DeepSeek-V3, the parallel_core GPTModel) take their
#: model_config in Hugging Face's field names, or megatron-core's, and convert them to TransformerConfig's; the
#: legacy names the table reads, by the names MindFormers accepts for them (its transformer_config_utils).
_MCORE_ALIASES: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer"),
    "num_heads": ("num_attention_heads", "n_head"),
    "n_kv_heads": ("num_key_value_heads", "num_query_groups"),
    "intermediate_size": ("ffn_hidden_size",),
    "theta": ("rope_theta", "rotary_base"),
    "max_position_embedding": ("max_position_embeddings",),
    "rms_norm_eps": ("layernorm_epsilon", "layer_norm_epsilon"),
    "qkv_has_bias": ("attention_bias", "add_qkv_bias"),
    "attn_proj_has_bias": ("add_bias_linear",),
    "init_method_std": ("initializer_range",),
    "param_init_type": ("params_dtype",),
    "layernorm_compute_type": ("layernorm_compute_dtype",),
    "softmax_compute_type": ("softmax_compute_dtype",),
}
#: TransformerConfig's defaults in MindFormers 1.9 (parallel_core/transformer_config.py) where they are not the
#: legacy Llama's the table holds: a field an mcore-style YAML leaves out takes these.
_MCORE_DEFAULTS: dict[str, Any] = {
    "num_layers": None, "num_attention_heads": None, "hidden_size": None, "seq_length": 4096, "vocab_rows": 128000,
    "init_method_std": 0.02, "params_dtype": "float32", "compute_dtype": "bfloat16", "grad_reduce_dtype": "float32",
    "hidden_dropout": 0.1, "attention_dropout": 0.1,
}


def _mcore_format(doc: dict[str, Any]) -> bool:
    """An mcore-style MindFormers YAML: ``use_legacy: False``, or a model_config in Hugging Face's field names."""
    model = _path(doc, "model.model_config")[1]
    hf_names = isinstance(model, dict) and any(k in model for k in ("num_hidden_layers", "num_attention_heads"))
    return doc.get("use_legacy") is False or str(doc.get("use_legacy")).lower() == "false" or hf_names


def _legacy_names(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``doc`` with its model_config's mcore-style names also under the legacy names the table reads (a legacy name
    the YAML sets itself wins; ``untie_embeddings_and_output_weights`` as ``tie_word_embeddings``), and each legacy
    path so filled -> the path the YAML holds (what a value's origin names)."""
    model = _path(doc, "model.model_config")[1]
    if not isinstance(model, dict):
        return doc, {}
    cfg, held = dict(model), {}
    for legacy, aliases in _MCORE_ALIASES.items():
        if cfg.get(legacy) is None:
            alias = next((a for a in aliases if cfg.get(a) is not None), None)
            if alias is not None:
                cfg[legacy], held[MC + legacy] = cfg[alias], MC + alias
    if cfg.get("tie_word_embeddings") is None and cfg.get("untie_embeddings_and_output_weights") is not None:
        cfg["tie_word_embeddings"] = not bool(cfg["untie_embeddings_and_output_weights"])
        held[MC + "tie_word_embeddings"] = MC + "untie_embeddings_and_output_weights (negated)"
    return {**doc, "model": {**doc["model"], "model_config": cfg}}, held


def mindformers_settings(doc: dict[str, Any], path: str, kind: str = "MindFormers YAML", *,
                         defaults: bool = True) -> Settings:
    """A MindFormers run configuration (the YAML ``run_mindformer.py --config`` reads) as settings: legacy model
    configs (LlamaConfig's field names) and mcore-style ones (``use_legacy: False``, Hugging Face's names)."""
    mcore = _mcore_format(doc)
    held: dict[str, str] = {}
    if mcore:
        doc, held = _legacy_names(doc)
    y = _Yaml(doc, defaults)
    out = Settings(path, kind, "mindformers")
    for row in TABLE:
        derive = MINDFORMERS_DERIVED.get(row.key)
        if derive is not None:
            value, used, note = derive(y)
            used = tuple(u for u in used if u)
            source = "set" if used else "default"
            origin = ", ".join(used) + (f" ({note})" if note else "") if used else \
                "default" + (f": {note}" if note else "")
        else:
            found, value = y.find(*row.mindformers)
            source = "set" if found else "default"
            value = value if found else row.mindformers_default
            origin = found if found else "default" + (f" of {row.mindformers[0].rsplit('.', 1)[-1]}"
                                                      if row.mindformers else ": fixed by MindFormers' code")
        for legacy, actual in held.items():  # name the field the YAML holds
            origin = re.sub(rf"{re.escape(legacy)}\b", actual, origin)
        if source == "default" and mcore and row.key in _MCORE_DEFAULTS:
            value, origin = _MCORE_DEFAULTS[row.key], "default of MindFormers' TransformerConfig"
            if value is None:
                continue  # no default: the model's own config must set it
        if source == "default" and not defaults:
            continue
        out.put(row.key, _typed(row.key, value), source, origin)
    load = doc.get("load_checkpoint")
    out.context["loads_checkpoint"] = bool(load) and str(load) not in ("None", "none", "''")
    known = {r.rsplit(".", 1)[-1] for row in TABLE for r in row.mindformers}
    known |= {alias for aliases in _MCORE_ALIASES.values() for alias in aliases} | {"untie_embeddings_and_output_weights"}
    model = _path(doc, "model.model_config")[1]
    out.unread = len([k for k in (model if isinstance(model, dict) else {}) if k not in known])
    return out


# ------------------------------------------------------------------------------------------------ Hugging Face
def _h_activation(doc: dict[str, Any]) -> Derived:
    act = doc.get("hidden_act", doc.get("activation_function"))
    if act is None:
        return None, (), ""
    name = str(act).lower()
    return ("swiglu" if name in ("silu", "swish") else _ACT_NAMES.get(name, name)), ("hidden_act",), \
        "Llama-family MLPs gate: silu = SwiGLU" if name in ("silu", "swish") else ""


def _h_rope_scaling(doc: dict[str, Any]) -> Derived:
    scaling = doc.get("rope_scaling")
    if not isinstance(scaling, dict):
        return "none", (("rope_scaling",) if "rope_scaling" in doc else ()), ""
    kind = str(scaling.get("rope_type", scaling.get("type", "?")))
    kind = "linear" if kind == "linear" else ("dynamic-ntk" if kind == "dynamic" else kind)
    return f"{kind} x{_g(scaling.get('factor', 1.0))}", ("rope_scaling",), ""


HF_DERIVED: dict[str, Callable[[dict[str, Any]], Derived]] = {
    "num_query_groups": lambda d: ((d["num_key_value_heads"], ("num_key_value_heads",), "")
                                   if d.get("num_key_value_heads") is not None else
                                   (d.get("num_attention_heads"), (), "one per head")),
    "normalization": lambda d: (("LayerNorm", ("layer_norm_eps",), "") if "layer_norm_eps" in d
                                or "layer_norm_epsilon" in d else ("RMSNorm", (), "")),
    "activation": _h_activation,
    "rope_scaling": _h_rope_scaling,
}


def hf_settings(doc: dict[str, Any], path: str, kind: str = "HF config.json", *, defaults: bool = True) -> Settings:
    """A Hugging Face ``config.json`` as settings (the model only: it holds no training settings)."""
    out = Settings(path, kind, "hf")
    for row in TABLE:
        derive = HF_DERIVED.get(row.key)
        if derive is not None:
            value, used, note = derive(doc)
            source = "set" if used else "default"
            origin = ", ".join(used) + (f" ({note})" if note else "") if used else \
                "default" + (f": {note}" if note else "")
        elif not row.hf:
            continue
        else:
            name = next((n for n in row.hf if doc.get(n) is not None), None)
            source = "set" if name else "default"
            value = doc[name] if name else row.hf_default
            origin = name if name else f"default of {row.hf[0]}"
        if source == "default" and not defaults:
            continue
        out.put(row.key, _typed(row.key, value), source, origin)
    known = {n for row in TABLE for n in row.hf}
    out.unread = len([k for k in doc if k not in known])
    return out
