"""megatron-core GPT (Llama config) trained under torchrun on the CPU with gloo: TP, TP+SP, DP, TP x DP.

    torchrun --standalone --nproc_per_node 2 examples/distributed/mcore_train.py --tp 2 --capture run.h5
    torchrun --standalone --nproc_per_node 2 examples/distributed/mcore_train.py --tp 2 --sp --capture run.h5
    torchrun --standalone --nproc_per_node 2 examples/distributed/mcore_train.py --dp 2 --capture run.h5
    python examples/distributed/mcore_train.py --capture ref.h5          # TP=1, DP=1: the reference

Every run starts from the same weights: the full (TP=1) model is built from --seed on each rank and each rank
keeps its tensor-parallel shard of it, cut the way megatron-core lays it out (linear_qkv per query group,
linear_fc1 [gate_r; up_r] per rank). The global batch (--batch sequences) is the same for every layout; each
data-parallel rank takes its share and the gradients are averaged over DP by hand (an all-reduce of each
gradient, divided by DP), as megatron's DDP does. Under sequence parallelism (--sp) the gradients of the
parameters megatron marks ``sequence_parallel`` (the norms) are partial sums over the sequence shards and are
all-reduced over the TP group, as megatron's ``finalize_model_grads`` does. Each rank writes its capture:
run.rank0.h5, run.rank1.h5, ...
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tensordiff
from tensordiff.compat.megatron_cpu import enable, sequence_parallel_torch_norms

VOCAB, HIDDEN, FFN, LAYERS, HEADS, GROUPS, SEQ = 128, 64, 128, 2, 4, 2, 16


def build(tp: int, seed: int, sp: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        init_method_std=0.05, normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False, tensor_model_parallel_size=tp,
        sequence_parallel=sp,
    )
    torch.manual_seed(seed)
    with sequence_parallel_torch_norms():  # the local spec's torch norms refuse SP otherwise (CPU: no fused norms)
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                        vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
                        position_embedding_type="rope")


def full_weights(seed: int) -> dict[str, torch.Tensor]:
    """The TP=1 model's weights from ``seed`` (every rank builds them the same way)."""
    g = torch.Generator().manual_seed(seed)
    w: dict[str, torch.Tensor] = {}
    hd = HIDDEN // HEADS

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    w["embedding.word_embeddings.weight"] = rnd(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        w[p + "self_attention.linear_qkv.weight"] = rnd((HEADS + 2 * GROUPS) * hd, HIDDEN)
        w[p + "self_attention.linear_proj.weight"] = rnd(HIDDEN, HEADS * hd)
        w[p + "pre_mlp_layernorm.weight"] = torch.ones(HIDDEN)
        w[p + "mlp.linear_fc1.weight"] = rnd(2 * FFN, HIDDEN)
        w[p + "mlp.linear_fc2.weight"] = rnd(HIDDEN, FFN)
    w["decoder.final_layernorm.weight"] = torch.ones(HIDDEN)
    w["output_layer.weight"] = rnd(VOCAB, HIDDEN)
    return w


FAULTS = {
    "none": "no fault",
    "qkv-split": "linear_qkv cut as [Q | K | V] sliced contiguously per rank (megatron packs per query group)",
    "fc1-split": "linear_fc1 [gate; up] sliced contiguously per rank (megatron holds [gate_r; up_r] on rank r)",
    "sp-noreduce": "sequence-parallel norm gradients not all-reduced over the TP group (partial sums stepped on)",
    "dp-sum": "gradients summed over data-parallel ranks instead of averaged",
    "dp-noreduce": "no data-parallel all-reduce of the gradients at all (each rank steps on its local gradient)",
}


def shard(name: str, full: torch.Tensor, param: torch.Tensor, tp: int, rank: int, fault: str = "none") -> torch.Tensor:
    """This TP rank's piece of ``full``, laid out as megatron-core lays out ``param`` (its partition attributes)."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    if "linear_qkv" in name and fault == "qkv-split":  # the converter's mistake: Megatron's rows read as [Q | K | V]
        hd = HIDDEN // HEADS
        q, k, v = full.split([HEADS * hd, GROUPS * hd, GROUPS * hd], dim=0)
        return torch.cat([q.chunk(tp)[rank], k.chunk(tp)[rank], v.chunk(tp)[rank]], dim=0)
    if "linear_qkv" in name:  # rows are per query group [q_g, k_g, v_g]: whole groups per rank
        return full.chunk(tp, dim=0)[rank]
    if stride > 1 and fault == "fc1-split":  # the converter's mistake: a plain contiguous cut (rank 0: all gate)
        return full.chunk(tp, dim=dim)[rank]
    if stride > 1:  # gated fc1: [gate; up] -> rank r holds [gate_r; up_r]
        return torch.cat([part.chunk(tp, dim=dim)[rank] for part in full.chunk(stride, dim=dim)], dim=dim)
    return full.chunk(tp, dim=dim)[rank]


def reduce_grads(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """What megatron's DDP and ``finalize_model_grads`` do after the backward pass, by hand: the sequence-parallel
    parameters' gradients all-reduced over TP, then every gradient averaged over DP."""
    from megatron.core import parallel_state

    if args.sp and args.fault != "sp-noreduce":
        for param in model.parameters():
            if getattr(param, "sequence_parallel", False) and param.grad is not None:
                dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
    dp = parallel_state.get_data_parallel_world_size()
    if dp > 1 and args.fault != "dp-noreduce":
        for param in model.parameters():
            dist.all_reduce(param.grad, group=parallel_state.get_data_parallel_group())
            if args.fault != "dp-sum":
                param.grad /= dp


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """This DP rank's share of the global batch: tokens, labels, position ids and the causal mask."""
    from megatron.core import parallel_state

    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (args.batch, SEQ + 1), generator=g)
    local = ids.chunk(dp, dim=0)[dp_rank]
    tokens, labels = local[:, :-1], local[:, 1:]
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(tokens.shape[0], -1)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    return tokens, labels, position_ids, causal


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences), split over DP")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--capture", help="capture file (one per rank: .rankN added)")
    p.add_argument("--fault", choices=sorted(FAULTS), default="none")
    args = p.parse_args()
    torch.set_num_threads(1)
    enable()
    from megatron.core import parallel_state, tensor_parallel

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != args.tp * args.dp:
        raise SystemExit(f"world size {dist.get_world_size()} is not --tp {args.tp} x --dp {args.dp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed, inference_rng_tracker=True, force_reset_rng=True)
    model = build(args.tp, args.seed, sp=args.sp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    full = full_weights(args.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(name, full[name], param, args.tp, tp_rank, args.fault))

    tokens, labels, position_ids, causal = batch(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    with tensordiff.capture(model, args.capture, steps=args.steps, optimizer=opt) as cap:
        for step in range(args.steps):
            loss = model(tokens, position_ids, causal, labels=labels).float().mean()
            loss.backward()
            reduce_grads(model, args)
            opt.step()
            opt.zero_grad(set_to_none=True)
            cap.step(loss)
            if dist.get_rank() == 0:
                print(f"mcore tp={args.tp} dp={args.dp} step {step}: loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
