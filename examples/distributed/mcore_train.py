"""megatron-core GPT (Llama config) trained under torchrun on the CPU with gloo: TP, TP+SP, DP, TP x DP, PP.

    torchrun --standalone --nproc_per_node 2 examples/distributed/mcore_train.py --tp 2 --capture run.h5
    torchrun --standalone --nproc_per_node 2 examples/distributed/mcore_train.py --tp 2 --sp --capture run.h5
    torchrun --standalone --nproc_per_node 2 examples/distributed/mcore_train.py --dp 2 --capture run.h5
    torchrun --standalone --nproc_per_node 2 examples/distributed/mcore_train.py --dp 2 --ddp megatron --capture run.h5
    torchrun --standalone --nproc_per_node 2 examples/distributed/mcore_train.py --pp 2 --capture run.h5
    torchrun --standalone --nproc_per_node 4 examples/distributed/mcore_train.py --tp 4 --groups 4 --capture run.h5
    torchrun --standalone --nproc_per_node 2 examples/distributed/mcore_train.py --pp 2 --tied --capture run.h5
    python examples/distributed/mcore_train.py --capture ref.h5          # TP=1, DP=1: the reference
    python examples/distributed/mcore_train.py --tied --capture ref.h5   # ... of the --tied runs

Every run starts from the same weights: the full (TP=1) model is built from --seed on each rank and each rank
keeps its tensor-parallel shard of it, cut the way megatron-core lays it out (linear_qkv per query group,
linear_fc1 [gate_r; up_r] per rank). The global batch (--batch sequences) is the same for every layout; each
data-parallel rank takes its share and the gradients are averaged over DP by hand (an all-reduce of each
gradient, divided by DP), as megatron's DDP does. Under sequence parallelism (--sp) the gradients of the
parameters megatron marks ``sequence_parallel`` (the norms) are partial sums over the sequence shards and are
all-reduced over the TP group, as megatron's ``finalize_model_grads`` does. Under pipeline parallelism (--pp)
each stage builds its share of the layers and loads them from the full weights under their global numbers;
megatron's own schedule (``get_forward_backward_func()``, one micro-batch of the whole local batch) runs the
forward and backward passes and hands the hidden states between the stages. Each rank writes its capture:
run.rank0.h5, run.rank1.h5, ... ``--tied`` ties the output layer to the word embeddings
(``share_embeddings_and_output_weights``, Megatron-LM's default): under TP the output layer is called with
``weight=`` the embedding's vocabulary shard; under PP the last stage holds a copy of the embedding matrix as its
``output_layer.weight`` (loaded from the embedding's weights) and the two copies' gradients are all-reduced over
megatron's embedding group by megatron's own ``_allreduce_word_embedding_grads`` (``--fault tied-noreduce``: not).
``--groups`` sets the query groups (default 2, GQA); TP must divide it, so TP=4
needs ``--groups 4`` (MHA), on the reference run too.
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


#: --bias: biases on every linear (megatron returns them apart, skip_bias_add); --pos learned: absolute positions;
#: --tied: the output layer uses the word embeddings' weight (share_embeddings_and_output_weights, Megatron-LM's default)
ARCH = {"bias": False, "pos": "rope", "tied": False}


def build(tp: int, seed: int, sp: bool = False, pp: int = 1):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        init_method_std=0.05, normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=ARCH["bias"],
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False, tensor_model_parallel_size=tp,
        sequence_parallel=sp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32 if pp > 1 else None,
    )
    stage = {} if pp == 1 else {"pre_process": parallel_state.is_pipeline_first_stage(),
                                "post_process": parallel_state.is_pipeline_last_stage()}
    torch.manual_seed(seed)
    with sequence_parallel_torch_norms():  # the local spec's torch norms refuse SP otherwise (CPU: no fused norms)
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                        vocab_size=VOCAB, max_sequence_length=SEQ,
                        share_embeddings_and_output_weights=ARCH["tied"],
                        position_embedding_type="rope" if ARCH["pos"] == "rope" else "learned_absolute", **stage)


def full_weights(seed: int) -> dict[str, torch.Tensor]:
    """The TP=1 model's weights from ``seed`` (every rank builds them the same way)."""
    g = torch.Generator().manual_seed(seed)
    w: dict[str, torch.Tensor] = {}
    hd = HIDDEN // HEADS

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    w["embedding.word_embeddings.weight"] = rnd(VOCAB, HIDDEN)
    if ARCH["pos"] == "learned":
        w["embedding.position_embeddings.weight"] = rnd(SEQ, HIDDEN)
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        w[p + "self_attention.linear_qkv.weight"] = rnd((HEADS + 2 * GROUPS) * hd, HIDDEN)
        w[p + "self_attention.linear_proj.weight"] = rnd(HIDDEN, HEADS * hd)
        w[p + "pre_mlp_layernorm.weight"] = torch.ones(HIDDEN)
        w[p + "mlp.linear_fc1.weight"] = rnd(2 * FFN, HIDDEN)
        w[p + "mlp.linear_fc2.weight"] = rnd(HIDDEN, FFN)
        if ARCH["bias"]:
            for name, size in (("self_attention.linear_qkv", (HEADS + 2 * GROUPS) * hd),
                               ("self_attention.linear_proj", HIDDEN), ("mlp.linear_fc1", 2 * FFN),
                               ("mlp.linear_fc2", HIDDEN)):
                w[p + name + ".bias"] = rnd(size)
    w["decoder.final_layernorm.weight"] = torch.ones(HIDDEN)
    w["output_layer.weight"] = rnd(VOCAB, HIDDEN)
    if ARCH["tied"]:  # one matrix for both ends: a last pipeline stage's copy of it loads the word embeddings
        w["output_layer.weight"] = w["embedding.word_embeddings.weight"]
    return w


FAULTS = {
    "none": "no fault",
    "qkv-split": "linear_qkv cut as [Q | K | V] sliced contiguously per rank (megatron packs per query group)",
    "fc1-split": "linear_fc1 [gate; up] sliced contiguously per rank (megatron holds [gate_r; up_r] on rank r)",
    "sp-noreduce": "sequence-parallel norm gradients not all-reduced over the TP group (partial sums stepped on)",
    "dp-sum": "gradients summed over data-parallel ranks instead of averaged",
    "dp-noreduce": "no data-parallel all-reduce of the gradients at all (each rank steps on its local gradient)",
    "bf16-allreduce": "gradients reduced over DP in BF16 (manual: cast to BF16 before the all-reduce; --ddp torch: "
                      "torch's bf16_compress_hook; --ddp megatron: its buckets scaled and all-reduced in BF16)",
    "pp-batch-first": "a pipeline stage hands its hidden states on batch first, [B, S, H], in the [S, B, H] shape "
                      "megatron's p2p expects (the next stage reads tokens of other sequences)",
    "pp-layer-offset": "a later pipeline stage loads its layers from the checkpoint by their stage-local numbers "
                       "(layer 0's weights into global layer 1)",
    "tied-noreduce": "--tied --pp > 1: the gradients of the tied embedding's two copies (the first stage's word "
                     "embeddings, the last stage's output layer) never all-reduced over the embedding group, so the "
                     "copies part after the first optimizer step (megatron's _allreduce_word_embedding_grads skipped)",
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
    """What megatron's DDP and ``finalize_model_grads`` do after the backward pass. --ddp manual, by hand: the
    sequence-parallel parameters' gradients all-reduced over TP, then every gradient averaged over DP (cast to BF16
    for the all-reduce under --fault bf16-allreduce). --ddp megatron: its DDP's ``finish_grad_sync`` (each bucket
    scaled by 1/DP and all-reduced; the gradients are in ``param.main_grad``), the TP all-reduce of the
    sequence-parallel ones, and ``param.grad`` a copy of ``main_grad`` for the torch optimizer (an alias would be
    accumulated into by the next backward). --ddp torch: DDP averaged them during backward."""
    from megatron.core import parallel_state

    if args.ddp == "megatron":
        model.finish_grad_sync()
    grads = [p.main_grad if args.ddp == "megatron" else p.grad for p in model.parameters()]
    if args.sp and args.fault != "sp-noreduce":
        for param, grad in zip(model.parameters(), grads):
            if getattr(param, "sequence_parallel", False) and grad is not None:
                dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
    dp = parallel_state.get_data_parallel_world_size()
    if args.ddp == "manual" and dp > 1 and args.fault != "dp-noreduce":
        for param in model.parameters():
            if args.fault == "bf16-allreduce":  # a port that reduces in BF16 to halve the traffic
                low = param.grad.to(torch.bfloat16)
                dist.all_reduce(low, group=parallel_state.get_data_parallel_group())
                param.grad.copy_(low)
            else:
                dist.all_reduce(param.grad, group=parallel_state.get_data_parallel_group())
            if args.fault != "dp-sum":
                param.grad /= dp
    if args.ddp == "megatron":
        for param in model.parameters():
            param.grad = param.main_grad.clone()
    if getattr(args, "tied", False) and getattr(args, "pp", 1) > 1 and args.fault != "tied-noreduce":
        allreduce_tied_embedding_grads(model)


def allreduce_tied_embedding_grads(model: torch.nn.Module) -> None:
    """--tied --pp > 1: the first stage's word embeddings and the last stage's output layer hold one weight in two
    copies; megatron's own ``_allreduce_word_embedding_grads`` (what ``finalize_model_grads`` calls) sums their
    gradients over the embedding group (the first and last stage), so both copies take the same step. It reads the
    DDP config from the model chunk it is given: the bare model here, with a plain config beside it."""
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_word_embedding_grads

    chunk = SimpleNamespace(module=model, ddp_config=DistributedDataParallelConfig())
    _allreduce_word_embedding_grads([chunk], model.config)


def wrap(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """--ddp megatron | torch: the model (its weights loaded) wrapped for data parallelism over megatron's DP group;
    --ddp manual: as it is (``reduce_grads`` all-reduces by hand)."""
    if args.ddp == "manual":
        return model
    if args.fault in ("dp-sum", "dp-noreduce"):
        raise SystemExit(f"--fault {args.fault} is a fault of the hand-written reduction: use it with --ddp manual")
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    if args.ddp == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        if args.fault == "bf16-allreduce":
            def bf16_compress_hook_gloo(state, bucket):  # DDP refuses the hook by its name off CUDA + NCCL; gloo
                return bf16_compress_hook(state, bucket)  # reduces BF16 on the CPU, so run torch's own hook inside

            ddp.register_comm_hook(group, bf16_compress_hook_gloo)
        return ddp
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=False), module=model)
    # megatron's train_step zeroes the gradient buffer before each step (here: one forward per step)
    ddp.register_forward_pre_hook(lambda module, inputs: module.zero_grad_buffer())
    if args.fault == "bf16-allreduce":
        for bucket_group in ddp.bucket_groups:
            bucket_group.start_grad_sync = bf16_bucket_sync(bucket_group.start_grad_sync, bucket_group)
    return ddp


def bf16_bucket_sync(start_grad_sync, bucket_group):
    """megatron's own bucket reduction run on a BF16 copy of each bucket (the 1/DP scaling and the all-reduce in
    BF16, as with a BF16 gradient buffer and grad_reduce_in_fp32 off), the result written back to the FP32 buffer."""
    def sync(*args, **kwargs):
        full = [bucket.grad_data for bucket in bucket_group.buckets]
        for bucket in bucket_group.buckets:
            bucket.grad_data = bucket.grad_data.to(torch.bfloat16)
        try:
            start_grad_sync(*args, **kwargs)
        finally:
            for bucket, buffer in zip(bucket_group.buckets, full):
                buffer.copy_(bucket.grad_data)
                bucket.grad_data = buffer
    return sync


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


def stage_layer_names(model: torch.nn.Module, fault: str = "none") -> dict[str, str]:
    """This pipeline stage's parameter names -> the full model's: ``decoder.layers.{i}`` is global layer
    ``layer_number - 1`` (megatron numbers layers globally, from 1); the rest keep their names."""
    rename = {}
    for i, layer in enumerate(model.decoder.layers):
        number = i if fault == "pp-layer-offset" else layer.layer_number - 1  # the fault: stage-local numbers
        rename[f"decoder.layers.{i}."] = f"decoder.layers.{number}."
    out = {}
    for name, _ in model.named_parameters():
        prefix = next((p for p in rename if name.startswith(p)), None)
        out[name] = rename[prefix] + name[len(prefix):] if prefix else name
    return out


def train_pipeline(args: argparse.Namespace) -> None:
    """--pp > 1: each rank builds its stage, loads its layers from the full weights and trains with megatron's
    pipeline schedule; every stage calls the capture's ``step`` with the step's loss (computed on the last stage,
    broadcast over the pipeline group for the others)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tensordiff.compat.megatron_cpu import pipeline_cpu

    with pipeline_cpu():  # the embedding setup moves weights with .cuda()
        model = build(args.tp, args.seed, sp=args.sp, pp=args.pp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    full = full_weights(args.seed)
    names = stage_layer_names(model, args.fault)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(names[name], full[names[name]], param, args.tp, tp_rank, args.fault))
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    data = batch(args)

    def loss_func(output: torch.Tensor):
        loss = output.float().mean()  # the per-token losses [B, S] -> the step's loss, as the TP=1 run takes it
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_iterator, model):
        tokens, labels, position_ids, causal = next(data_iterator)
        out = model(tokens, position_ids, causal, labels=labels)
        if args.fault == "pp-batch-first" and first and not last:  # [S, B, H] made batch first, sent as [S, B, H]
            out = out.transpose(0, 1).contiguous().view(out.shape)
        return out, loss_func

    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    schedule = get_forward_backward_func()
    src, group = parallel_state.get_pipeline_model_parallel_last_rank(), parallel_state.get_pipeline_model_parallel_group()
    with tensordiff.capture(model, args.capture, steps=args.steps, optimizer=opt) as cap:
        for step in range(args.steps):
            with pipeline_cpu():
                losses = schedule(forward_step_func=forward_step, data_iterator=iter([data]), model=model,
                                  num_microbatches=1, seq_length=SEQ, micro_batch_size=data[0].shape[0])
            loss = losses[0]["loss"] if last else torch.zeros((), dtype=torch.float32)
            dist.broadcast(loss, src=src, group=group)  # the last stage's loss, known on every stage
            reduce_grads(model, args)
            opt.step()
            opt.zero_grad(set_to_none=True)
            cap.step(loss)
            if dist.get_rank() == 0:
                print(f"mcore tp={args.tp} dp={args.dp} pp={args.pp} step {step}: loss {loss.item():.6f}", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages (megatron's schedule)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences), split over DP")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--capture", help="capture file (one per rank: .rankN added)")
    p.add_argument("--fault", choices=sorted(FAULTS), default="none")
    p.add_argument("--bias", action="store_true", help="biases on every linear layer (add_bias_linear)")
    p.add_argument("--pos", choices=("rope", "learned"), default="rope", help="position embeddings")
    p.add_argument("--tied", action="store_true", help="tied embeddings: the output layer uses the word embeddings' "
                   "weight (share_embeddings_and_output_weights=True; on --pp > 1 the last stage's copy of it, its "
                   "gradient all-reduced with the first stage's over megatron's embedding group)")
    p.add_argument("--groups", type=int, default=GROUPS,
                   help=f"query groups (default {GROUPS}; {HEADS}: MHA); --tp must divide it")
    p.add_argument("--ddp", choices=("manual", "megatron", "torch"), default="manual",
                   help="data-parallel gradient reduction: by hand (manual), megatron-core's DistributedDataParallel "
                        "or torch's DistributedDataParallel over megatron's DP group")
    args = p.parse_args(argv)
    if HEADS % args.groups or args.groups % args.tp:
        raise SystemExit(f"--groups {args.groups}: must divide the {HEADS} heads and be a multiple of --tp {args.tp}")
    if args.ddp != "manual" and args.pp > 1:
        raise SystemExit("--ddp megatron | torch: not with --pp (the pipeline path reduces by hand)")
    if args.fault.startswith("pp-") and args.pp == 1:
        raise SystemExit(f"--fault {args.fault} is a pipeline fault: use it with --pp 2 or more")
    if args.fault == "tied-noreduce" and not (args.tied and args.pp > 1):
        raise SystemExit("--fault tied-noreduce is a fault of tied embeddings across pipeline stages: use it with "
                         "--tied --pp 2 or more")
    return args


def run(args: argparse.Namespace) -> None:
    """One run in this process's (gloo) process group: megatron's parallel state set up for ``args``, the model built,
    trained and captured, the parallel state torn down (so that another run may follow in the same processes)."""
    global GROUPS
    GROUPS = args.groups
    ARCH.update(bias=args.bias, pos=args.pos, tied=args.tied)
    from megatron.core import parallel_state, tensor_parallel

    if dist.get_world_size() != args.tp * args.dp * args.pp:
        raise SystemExit(f"world size {dist.get_world_size()} is not --tp {args.tp} x --dp {args.dp} x --pp {args.pp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                             pipeline_model_parallel_size=args.pp)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed, inference_rng_tracker=True, force_reset_rng=True)
    try:
        if args.pp > 1:
            train_pipeline(args)
        else:
            train(args)
    finally:
        parallel_state.destroy_model_parallel()


def train(args: argparse.Namespace) -> None:
    from megatron.core import parallel_state

    model = build(args.tp, args.seed, sp=args.sp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    full = full_weights(args.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(name, full[name], param, args.tp, tp_rank, args.fault))
    model = wrap(model, args)

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


def init_process_group() -> None:
    """gloo, under torchrun (its environment) or alone (one process, an in-memory store)."""
    torch.set_num_threads(1)
    enable()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    init_process_group()
    run(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
