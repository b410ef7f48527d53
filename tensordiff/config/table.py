"""The equivalence table: one row per setting that changes what a training run computes, with its name and default in
Megatron-LM, MindFormers and Hugging Face ``config.json``, how two values are compared and why a difference matters.

Data, not code: the readers (``normalize``) look a row's names up and fall back to its defaults; the few settings that
are computed from several flags (the padded vocabulary, the activation, the dtypes, loss scaling, the schedule) are
derived there and named here in words. Defaults are those of the frameworks' own documentation and code: Megatron-LM's
``arguments.py`` (which sets megatron-core's ``TransformerConfig``, ``OptimizerConfig`` and ``GPTModel`` arguments,
checked against those dataclasses by ``tests/test_config.py``), MindFormers 1.9's legacy ``LlamaConfig``, ``AdamW``,
``MFTrainOneStepCell`` and lr schedules, and transformers' ``LlamaConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Row:
    key: str
    """the canonical name of the setting."""
    label: str
    megatron: tuple[str, ...]
    """Megatron-LM argument names (``args.NAME``; the flag is ``--NAME`` with dashes), first found wins; a row whose
    value is derived names the arguments it is derived from."""
    mindformers: tuple[str, ...]
    """dotted paths in a MindFormers YAML, first found wins (``model.model_config.`` for the model's fields)."""
    hf: tuple[str, ...]
    """keys of a Hugging Face ``config.json``."""
    megatron_default: Any
    mindformers_default: Any
    hf_default: Any
    compare: str
    """'exact', 'float' (relative 1e-9) or 'dtype' (names normalized: bf16 = bfloat16 = mstype.bfloat16 ...)."""
    why: str
    """one line: what a difference does to the run."""
    when: str = ""
    """compared only when this holds (see ``compare.CONDITIONS``): 'rope', 'moe', 'decay', 'warmup', 'weight_decay',
    'from_scratch'; otherwise listed as not applicable."""
    derived: str = ""
    """for a derived row, how (shown in docs/config.md)."""


MC = "model.model_config."
#: Settings a MindFormers Llama does not have: fixed by the model's code.
NONE = None

TABLE: tuple[Row, ...] = (
    # ---------------------------------------------------------------- the model
    Row("num_layers", "layers", ("num_layers",), (MC + "num_layers",), ("num_hidden_layers",), None, 32, None, "exact",
        "a different model: the checkpoint does not fit"),
    Row("hidden_size", "hidden size", ("hidden_size",), (MC + "hidden_size",), ("hidden_size",), None, 4096, None,
        "exact", "a different model: the checkpoint does not fit"),
    Row("ffn_hidden_size", "MLP hidden size", ("ffn_hidden_size",), (MC + "intermediate_size",),
        ("intermediate_size",), None, None, None, "exact", "a different MLP: the checkpoint does not fit",
        derived="Megatron: 4 x hidden (SwiGLU: int(8/3 hidden / 64) x 64) when absent; MindFormers: from multiple_of "
                "and ffn_dim_multiplier when intermediate_size is absent"),
    Row("num_attention_heads", "attention heads", ("num_attention_heads",), (MC + "num_heads",),
        ("num_attention_heads",), None, 32, None, "exact", "a different head split of the same weights"),
    Row("num_query_groups", "KV heads (query groups)", ("num_query_groups", "group_query_attention"),
        (MC + "n_kv_heads",), ("num_key_value_heads",), None, None, None, "exact",
        "grouped-query attention: K/V projections of another shape",
        derived="the number of heads when GQA is off (Megatron: no --group-query-attention; n_kv_heads / "
                "num_key_value_heads absent)"),
    Row("seq_length", "sequence length", ("seq_length",), (MC + "seq_length",), (), None, 2048, None, "exact",
        "each sample holds another number of tokens: another loss"),
    Row("max_position_embeddings", "max positions", ("max_position_embeddings",), (MC + "max_position_embedding",),
        ("max_position_embeddings",), None, None, 2048, "exact",
        "the position table's length (learned positions: the checkpoint does not fit)",
        derived="the sequence length when absent"),
    Row("vocab_rows", "vocabulary rows (padded)", ("padded_vocab_size", "vocab_size", "make_vocab_size_divisible_by",
                                                   "tensor_model_parallel_size", "tokenizer_type"),
        (MC + "vocab_size",), ("vocab_size",), None, 32000, 32000, "exact",
        "embedding and output layer of another size: the checkpoint does not fit, the softmax spans other rows",
        derived="Megatron pads the tokenizer's vocabulary up to a multiple of make-vocab-size-divisible-by x TP "
                "(NullTokenizer: --vocab-size + 1 for its eod); the log's 'padded vocab' line when there is one; "
                "MindFormers and HF use vocab_size as is"),
    Row("num_experts", "experts", ("num_experts",), (MC + "moe_config.expert_num", "moe_config.expert_num"),
        ("num_local_experts", "num_experts"), 1, 1, 1, "exact", "a mixture of experts on one side only",
        derived="1 when absent (a dense model)"),
    Row("position_embedding", "position embedding", ("position_embedding_type",), (), (), "learned_absolute", "rope",
        "rope", "exact", "another way of encoding positions"),
    Row("normalization", "normalization", ("normalization",), (), (), "LayerNorm", "RMSNorm", "RMSNorm", "exact",
        "LayerNorm subtracts the mean, RMSNorm does not"),
    Row("norm_epsilon", "norm epsilon", ("norm_epsilon", "layernorm_epsilon"), (MC + "rms_norm_eps",),
        ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"), 1e-5, 1e-5, 1e-6, "float",
        "every norm's output shifts, most where activations are small"),
    Row("apply_layernorm_1p", "norm weight + 1 (layernorm-1p)", ("apply_layernorm_1p",), (), (), False, False, False,
        "exact", "the norm multiplies by (1 + weight): the same checkpoint scales activations differently"),
    Row("activation", "MLP activation", ("swiglu", "squared_relu", "openai_gelu", "onnx_safe"), (MC + "hidden_act",),
        ("hidden_act",), "gelu", "swiglu", "swiglu", "exact", "another MLP function (and SwiGLU has two input halves)",
        derived="Megatron: swiglu with --swiglu, squared-relu with --squared-relu, else gelu; MindFormers' Llama is "
                "SwiGLU; HF Llama-family: hidden_act silu = swiglu"),
    Row("rotary_base", "RoPE base (theta)", ("rotary_base",), (MC + "theta",), ("rope_theta",), 10000, 10000.0,
        10000.0, "float", "every rotary angle changes: attention scores differ from layer 0", when="rope"),
    Row("rotary_percent", "RoPE fraction of head dim", ("rotary_percent",), (), ("partial_rotary_factor",), 1.0, 1.0,
        1.0, "float", "another share of each head is rotated", when="rope"),
    Row("rope_scaling", "RoPE scaling", ("use_rope_scaling", "rope_scaling_factor",
                                         "rotary_seq_len_interpolation_factor"),
        (MC + "extend_method", MC + "scaling_factor"), ("rope_scaling",), "none", "none", "none", "exact",
        "the rotary frequencies are rescaled on one side", when="rope",
        derived="'none', or the method and its factor: Megatron --use-rope-scaling = llama3 x --rope-scaling-factor, "
                "--rotary-seq-len-interpolation-factor F = linear x F; MindFormers extend_method (PI = linear) x "
                "scaling_factor; HF rope_scaling {rope_type, factor}"),
    Row("qkv_bias", "QKV bias", ("add_qkv_bias", "add_bias_linear"), (MC + "qkv_has_bias",), ("attention_bias",),
        True, False, False, "exact", "a bias on one side only: extra parameters, other outputs",
        derived="Megatron: --add-qkv-bias or the linear biases (on by default; --disable-bias-linear)"),
    Row("linear_bias", "other linear biases", ("add_bias_linear",), (MC + "attn_proj_has_bias",), ("mlp_bias",), True,
        False, False, "exact", "a bias on one side only: extra parameters, other outputs",
        derived="Megatron: on unless --disable-bias-linear; MindFormers: the attention output's (its Llama MLP has "
                "none); HF: mlp_bias"),
    Row("tied_embeddings", "tied embedding / output", ("untie_embeddings_and_output_weights",),
        (MC + "tie_word_embeddings",), ("tie_word_embeddings",), True, False, False, "exact",
        "one matrix or two: the output layer's weights and their gradients differ",
        derived="Megatron ties them unless --untie-embeddings-and-output-weights"),
    Row("hidden_dropout", "hidden dropout", ("hidden_dropout",),
        (MC + "hidden_dropout", MC + "hidden_dropout_prob", MC + "hidden_dropout_rate"),
        ("hidden_dropout", "hidden_dropout_prob", "resid_pdrop"), 0.1, 0.0, 0.0, "float",
        "random masks on one side: no step can match (set both to 0 to compare)"),
    Row("attention_dropout", "attention dropout", ("attention_dropout",),
        (MC + "attention_dropout", MC + "attention_dropout_prob", MC + "attention_dropout_rate"),
        ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop"), 0.1, 0.0, 0.0, "float",
        "random masks on one side: no step can match (set both to 0 to compare)"),
    Row("init_method_std", "init std", ("init_method_std",), (MC + "init_method_std",), ("initializer_range",), 0.02,
        0.01, 0.02, "float", "weights drawn from another distribution (both sides initialize)", when="from_scratch"),
    # ---------------------------------------------------------------- precision
    Row("params_dtype", "parameter (init) dtype", ("params_dtype", "bf16", "fp16"), (MC + "param_init_type",),
        ("torch_dtype", "dtype"), "float32", "float16", "float32", "dtype",
        "the weights are stored and updated in another precision",
        derived="Megatron: bfloat16 with --bf16, float16 with --fp16, else float32"),
    Row("compute_dtype", "compute dtype", ("bf16", "fp16"), (MC + "compute_dtype",), ("torch_dtype", "dtype"),
        "float32", "float16", "float32", "dtype", "matmuls in another precision: differences of 1e-3 (bf16) per layer",
        derived="Megatron: bfloat16 with --bf16, float16 with --fp16, else float32"),
    Row("norm_dtype", "norm compute dtype", (), (MC + "layernorm_compute_type",), (), "float32", "float32", "float32",
        "dtype", "the norms' statistics in another precision",
        derived="Megatron's norms (Transformer Engine, Apex, torch) compute in float32"),
    Row("softmax_dtype", "softmax compute dtype", ("attention_softmax_in_fp32", "bf16", "fp16"),
        (MC + "softmax_compute_type",), (), "float32", "float32", "float32", "dtype",
        "attention probabilities in another precision",
        derived="Megatron: float32 with --attention-softmax-in-fp32 or a float32 model, else its compute dtype"),
    Row("rotary_dtype", "RoPE compute dtype", ("bf16", "fp16"), (MC + "rotary_dtype",), (), "float32", "float32",
        "float32", "dtype", "the rotated queries and keys in another precision", when="rope",
        derived="Megatron casts cos/sin to the activations' dtype (its compute dtype)"),
    Row("grad_reduce_dtype", "gradient reduction dtype", ("accumulate_allreduce_grads_in_fp32", "grad_reduce_in_bf16",
                                                          "bf16", "fp16"),
        (MC + "param_init_type",), (), "float32", "float16", None, "dtype",
        "gradients summed across ranks and micro-batches in another precision",
        derived="Megatron: float32 with --accumulate-allreduce-grads-in-fp32 (set by --bf16 unless "
                "--grad-reduce-in-bf16), else its parameter dtype; MindFormers: the parameters' dtype"),
    Row("loss_scaling", "loss scaling", ("fp16", "loss_scale", "initial_loss_scale"),
        ("runner_wrapper.scale_sense",), (), "none", "none", None, "exact",
        "gradients scaled (and steps skipped on overflow) on one side",
        derived="'none', 'static S' or 'dynamic from S': Megatron scales only with --fp16 (--loss-scale S static, "
                "else dynamic from --initial-loss-scale 2^32); MindFormers scale_sense: a number (1 = none) or a "
                "Dynamic/FixedLossScaleUpdateCell"),
    Row("moe_aux_loss_coeff", "MoE aux-loss coefficient", ("moe_aux_loss_coeff",),
        (MC + "moe_config.aux_loss_factor", "moe_config.aux_loss_factor", MC + "moe_aux_loss_coeff"), (), 0.0, 0.05,
        None, "float", "another load-balancing term in the loss and its gradients", when="moe"),
    Row("moe_z_loss_coeff", "MoE z-loss coefficient", ("moe_z_loss_coeff",),
        (MC + "moe_config.z_loss_factor", "moe_config.z_loss_factor", MC + "moe_z_loss_coeff"), (), 0.0, 0.0, None,
        "float", "another router z-loss term in the loss and its gradients", when="moe",
        derived="Megatron: --moe-z-loss-coeff (None = 0)"),
    # ---------------------------------------------------------------- optimizer
    Row("optimizer", "optimizer", ("optimizer", "decoupled_weight_decay"), ("optimizer.type",), (), "adamw", "adamw",
        None, "exact", "another update rule", derived="Megatron's adam decouples weight decay (AdamW)"),
    Row("adam_beta1", "Adam beta1", ("adam_beta1",), ("optimizer.betas",), (), 0.9, 0.9, None, "float",
        "another momentum: every update differs from step 1"),
    Row("adam_beta2", "Adam beta2", ("adam_beta2",), ("optimizer.betas",), (), 0.999, 0.999, None, "float",
        "another second-moment average: every update differs from step 1"),
    Row("adam_eps", "Adam epsilon", ("adam_eps",), ("optimizer.eps",), (), 1e-8, 1e-8, None, "float",
        "updates of parameters with small gradients differ"),
    Row("weight_decay", "weight decay", ("weight_decay",), ("optimizer.weight_decay",), (), 0.01, 0.0, None, "float",
        "parameters shrink at another rate every step"),
    Row("weight_decay_params", "weight decay applies to", ("apply_wd_to_qk_layernorm",), (), (),
        "matrices (not biases, not 1-D weights)", "matrices (not biases, not 1-D weights)", None, "exact",
        "some parameters decay on one side only", when="weight_decay",
        derived="Megatron: no decay on biases and 1-D weights (norms), q/k norms decay with "
                "--apply-wd-to-qk-layernorm; MindFormers' get_optimizer_grouped_parameters: the same rule"),
    Row("clip_grad", "gradient clipping (max norm, 0 = off)", ("clip_grad",),
        ("runner_wrapper.use_clip_grad", "runner_wrapper.max_grad_norm"), (), 1.0, 0.0, None, "float",
        "large gradients are scaled down on one side only",
        derived="MindFormers: max_grad_norm (1.0) when use_clip_grad (MFTrainOneStepCell: False), else 0"),
    # ---------------------------------------------------------------- learning rate
    Row("lr", "learning rate (peak)", ("lr",), ("lr_schedule.learning_rate", "optimizer.learning_rate"), (), None,
        None, None, "float", "every update is scaled differently"),
    Row("lr_schedule", "lr schedule", ("lr_decay_style",), ("lr_schedule.type",), (), "linear", "constant", None,
        "exact", "the learning rate follows another curve after warm-up",
        derived="MindFormers' class as Megatron's style: ConstantWarmUpLR = constant, LinearWithWarmUpLR = linear, "
                "CosineWithWarmUpLR = cosine, WarmUpStableDecayLR = WSD, PolynomialWithWarmUpLR = polynomial"),
    Row("lr_warmup_steps", "lr warm-up steps", ("lr_warmup_iters", "lr_warmup_fraction"),
        ("lr_schedule.warmup_steps", "lr_schedule.warmup_ratio"), (), 0, 0, None, "exact",
        "the learning rate ramps up over another number of steps",
        derived="a warm-up fraction or ratio times the decay steps (Megatron: --lr-decay-iters or --train-iters)"),
    Row("lr_warmup_init", "lr at warm-up start", ("lr_warmup_init",), ("lr_schedule.warmup_lr_init",), (), 0.0, 0.0,
        None, "float", "the warm-up starts from another learning rate", when="warmup"),
    Row("min_lr", "minimum lr", ("min_lr",), ("lr_schedule.lr_end", "lr_schedule.min_lr", "lr_schedule.eta_min"), (),
        0.0, 0.0, None, "float", "the schedule decays to another floor", when="decay"),
    # ---------------------------------------------------------------- batch
    Row("micro_batch_size", "micro-batch size", ("micro_batch_size",), ("runner_config.batch_size", MC + "batch_size"),
        (), None, 1, None, "exact", "another number of samples per forward pass"),
    Row("global_batch_size", "global batch size", ("global_batch_size", "micro_batch_size", "data_parallel_size"),
        ("runner_config.batch_size", "runner_config.gradient_accumulation_steps", "parallel_config.data_parallel",
         "parallel_config.micro_batch_num"), (), None, None, None, "exact",
        "each step averages the gradient over another number of samples",
        derived="MindFormers: batch_size x data_parallel x gradient_accumulation_steps (x micro_batch_num with "
                "pipeline stages); Megatron: --global-batch-size, else micro-batch x data-parallel size"),
)

ROWS: dict[str, Row] = {row.key: row for row in TABLE}

#: Megatron-LM's defaults for the arguments the rows read (``megatron/training/arguments.py``), used for a flags file
#: or a command line where a flag is absent. The ones megatron-core also holds are checked against its dataclasses.
MEGATRON_DEFAULTS: dict[str, Any] = {
    "num_layers": None, "hidden_size": None, "ffn_hidden_size": None, "num_attention_heads": None,
    "group_query_attention": False, "num_query_groups": 1, "seq_length": None, "max_position_embeddings": None,
    "vocab_size": None, "make_vocab_size_divisible_by": 128, "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1, "tokenizer_type": None, "num_experts": None,
    "position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "norm_epsilon": 1e-5,
    "apply_layernorm_1p": False, "swiglu": False, "squared_relu": False, "openai_gelu": False,
    "rotary_base": 10000, "rotary_percent": 1.0, "use_rope_scaling": False, "rope_scaling_factor": 8.0,
    "rotary_seq_len_interpolation_factor": None, "add_bias_linear": True, "add_qkv_bias": False,
    "untie_embeddings_and_output_weights": False, "hidden_dropout": 0.1, "attention_dropout": 0.1,
    "init_method_std": 0.02, "fp16": False, "bf16": False, "attention_softmax_in_fp32": False,
    "accumulate_allreduce_grads_in_fp32": False, "grad_reduce_in_bf16": False, "loss_scale": None,
    "initial_loss_scale": 2 ** 32, "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None, "optimizer": "adam",
    "decoupled_weight_decay": True, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8, "weight_decay": 0.01,
    "apply_wd_to_qk_layernorm": False, "clip_grad": 1.0, "lr": None, "lr_decay_style": "linear",
    "lr_warmup_iters": 0, "lr_warmup_fraction": None, "lr_warmup_init": 0.0, "lr_decay_iters": None,
    "train_iters": None, "min_lr": 0.0, "micro_batch_size": None, "global_batch_size": None, "load": None,
}

#: Megatron-LM flags that store False in another argument (``--disable-bias-linear`` -> add_bias_linear = False).
MEGATRON_STORE_FALSE: dict[str, str] = {
    "disable_bias_linear": "add_bias_linear", "no_position_embedding": "add_position_embedding",
}

#: MindFormers lr schedule classes as Megatron-LM's --lr-decay-style.
MINDFORMERS_LR_STYLES: dict[str, str] = {
    "ConstantWarmUpLR": "constant", "LinearWithWarmUpLR": "linear", "CosineWithWarmUpLR": "cosine",
    "CosineWithRestartsAndWarmUpLR": "cosine-restarts", "PolynomialWithWarmUpLR": "polynomial",
    "WarmUpStableDecayLR": "WSD", "ConstantWithCoolDownLR": "constant-cooldown", "CosineAnnealingLR": "cosine",
    "CosineAnnealingWarmRestarts": "cosine-restarts",
}

#: Every spelling of a dtype, as one name.
DTYPES: dict[str, str] = {
    "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32", "single": "float32", "fp64": "float64",
    "float64": "float64", "double": "float64",
}


def dtype_name(value: Any) -> str | None:
    """'bf16', 'torch.bfloat16', 'mstype.bfloat16', 'BFloat16' ... -> 'bfloat16'; None when not a dtype name."""
    if value is None:
        return None
    text = str(value).strip().strip("'\"").lower().rsplit(".", 1)[-1]
    return DTYPES.get(text)
