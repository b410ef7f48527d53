"""The Megatron side: megatron-core GPTModel on the CPU, trained on the shared batch with capture on.

    python examples/megatron_vs_mindformers/megatron_side.py --family llama --batch batch.h5 \\
        --save-ckpt init.safetensors --capture mcore.h5

Builds the model of ``--family`` (see spec.py) from ``--seed``, or loads ``--load-ckpt``;
``--save-ckpt`` writes the starting weights (megatron-core names, safetensors) for the
other side to convert. Plain SGD, loss = masked mean of Megatron's per-token loss.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F

import tensordiff
from examples.megatron_vs_mindformers.spec import FAMILIES, Spec
from tensordiff.batch import load as load_batch
from tensordiff.compat.megatron_cpu import init_megatron_cpu
from tensordiff.errors import TensordiffError


def _init_megatron_cuda(seed: int) -> None:
    """One process, one GPU: an NCCL group (megatron-core's DDP all-reduces CUDA tensors) with an in-process
    store, TP=PP=1, megatron's CUDA RNG tracker."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_mcore(spec: Spec, seed: int, device: str = "cpu") -> Any:
    """megatron-core GPTModel (local layer spec, FP32, no dropout) for ``spec``."""
    if device == "cuda":
        _init_megatron_cuda(seed)
    else:
        init_megatron_cpu(seed)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    gpt2 = spec.family == "gpt2"
    norm = "LayerNorm" if gpt2 else "RMSNorm"
    gelu = functools.partial(F.gelu, approximate="tanh") if spec.gelu == "tanh" else F.gelu
    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        init_method_std=spec.init_std,
        normalization=norm,
        layernorm_epsilon=spec.layernorm_epsilon,
        add_bias_linear=gpt2,
        gated_linear_unit=not gpt2,
        activation_func=gelu if gpt2 else F.silu,
        bias_activation_fusion=False,
        qk_layernorm=spec.qk_layernorm,
    )
    torch.manual_seed(seed)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=norm, qk_layernorm=spec.qk_layernorm),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        share_embeddings_and_output_weights=gpt2,
        position_embedding_type="learned_absolute" if gpt2 else "rope",  # type: ignore[arg-type]
        rotary_base=spec.rotary_base,
    )


FAULTS = {
    "none": "no fault",
    "rope-interleaved": "llama/qwen3: RoPE on interleaved (GPT-J) pairs instead of rotate-half",
    "rope-base": "llama/qwen3: RoPE base 500000 instead of 10000",
    "bf16-fc1": "layer 0's linear_fc1 computes in BF16 (inputs, weight and output rounded)",
    "norm-eps": "layer 1's pre-MLP RMSNorm uses epsilon 3e-4 instead of 1e-6",
    "swiglu-swapped": "layer 0's SwiGLU computes silu(up) * gate instead of silu(gate) * up",
}


def inject_late(model: Any, fault: str) -> list[Any]:
    """Faults that act on a module's output after capture recorded it (registered once capture is on)."""
    if fault != "swiglu-swapped":
        return []

    def swap_halves(module: Any, args: Any, output: Any) -> Any:
        out, bias = output
        gate, up = torch.chunk(out, 2, dim=-1)
        return torch.cat([up, gate], dim=-1), bias  # MLP's glu then takes silu(up) * gate

    mlp = model.decoder.layers[0].mlp
    return [mlp.linear_fc1.register_forward_hook(swap_halves)]


def inject(model: Any, fault: str) -> None:
    """One deliberate difference on the Megatron side (for the hint tests: A = plain run, B = this)."""
    if fault == "rope-interleaved":
        model.rotary_pos_emb.rotary_interleaved = True
        for layer in model.decoder.layers:
            layer.self_attention.config.rotary_interleaved = True
    elif fault == "rope-base":
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        old = model.rotary_pos_emb
        model.rotary_pos_emb = RotaryEmbedding(kv_channels=old.inv_freq.numel() * 2, rotary_percent=1.0,
                                               rotary_interleaved=False, rotary_base=500000,
                                               use_cpu_initialization=True)
    elif fault == "norm-eps":
        norm = model.decoder.layers[1].pre_mlp_layernorm
        norm.eps = 3e-4
    elif fault == "bf16-fc1":
        fc1 = model.decoder.layers[0].mlp.linear_fc1

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            out = F.linear(x.bfloat16(), fc1.weight.bfloat16()).float()
            return out, (fc1.bias if fc1.skip_bias_add else None)

        fc1.forward = forward


def gpt2_model() -> Any:
    """For ``tensordiff replay --model examples.megatron_vs_mindformers.megatron_side:gpt2_model``."""
    return build_mcore(FAMILIES["gpt2"], 1234)


def llama_model() -> Any:
    """For ``tensordiff replay --model examples.megatron_vs_mindformers.megatron_side:llama_model``."""
    return build_mcore(FAMILIES["llama"], 1234)


def state_for_saving(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="gpt2")
    p.add_argument("--batch", required=True, help="batch file written by tensordiff batch")
    p.add_argument("--seed", type=int, default=1234, help="seed of the initial weights")
    p.add_argument("--save-ckpt", help="write the initial weights here (safetensors, megatron-core names)")
    p.add_argument("--load-ckpt", help="start from these weights (safetensors, megatron-core names)")
    p.add_argument("--train-steps", type=int, default=2)
    p.add_argument("--capture", help="capture file (tensordiff capture -o sets it instead)")
    p.add_argument("--capture-steps", type=int, default=2)
    p.add_argument("--fault", choices=sorted(FAULTS), default="none", help="one deliberate difference (hint tests)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--bf16", action="store_true", help="train in BF16 the way Megatron-LM does (Float16Module)")
    args = p.parse_args(argv)
    spec = FAMILIES[args.family]

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    model = build_mcore(spec, args.seed, args.device)
    if args.load_ckpt:
        from safetensors.torch import load_file

        missing, unexpected = model.load_state_dict(load_file(args.load_ckpt), strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise TensordiffError(f"{args.load_ckpt}: does not fit the {args.family} model: missing {missing}, "
                                  f"unexpected {unexpected}")
    if args.save_ckpt:
        from safetensors.torch import save_file

        save_file(state_for_saving(model), args.save_ckpt)
    inject(model, args.fault)
    b = load_batch(args.batch, vocab_size=spec.vocab_size, framework="torch")
    if args.device == "cuda":
        model = model.cuda()
        b = {k: v.cuda() for k, v in b.items()}
    if args.bf16:  # as Megatron-LM: BF16 parameters, inputs cast on the way in (module names gain 'module.')
        from megatron.core.transformer.module import Float16Module

        model.config.bf16 = True
        model.config.params_dtype = torch.bfloat16
        model = Float16Module(model.config, model)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr)
    losses = []
    with tensordiff.capture(model, args.capture, steps=args.capture_steps, optimizer=opt) as cap:
        inject_late(model, args.fault)
        for step in range(args.train_steps):
            per_token = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])  # [B, S]
            loss = (per_token.float() * b["loss_mask"]).sum() / b["loss_mask"].sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            cap.step(loss)
            losses.append(loss.item())
            print(f"megatron-core {args.family} step {step}: loss {loss.item():.6f}", flush=True)
    return losses


if __name__ == "__main__":
    try:
        main()
    except TensordiffError as err:
        print(f"tensordiff: error: {err}", file=sys.stderr)
        sys.exit(2)
