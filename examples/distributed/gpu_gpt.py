"""megatron-core GPT (Llama config) on GPUs in BF16, captured with tensordiff: TP, DP, megatron DDP, timings.

The model is megatron-core's ``GPTModel`` with the local layer spec (no Transformer Engine): RMSNorm, SwiGLU,
RoPE, grouped-query attention, no biases. In BF16 it is wrapped as Megatron-LM wraps it, in ``Float16Module``
(module names gain a ``module.`` prefix), and with ``--ddp megatron`` in megatron-core's
``DistributedDataParallel`` (``overlap_grad_reduce=False``, ``use_distributed_optimizer=False``,
``grad_reduce_in_fp32`` from ``--grad-reduce``): ``zero_grad_buffer()`` before each step, ``finish_grad_sync()``
after backward, and ``param.grad`` a copy of ``main_grad`` (in the parameter's dtype) for the torch optimizer.

Every run starts from the same weights and batch, whatever its layout and device: each full (TP=1) weight is
drawn on the CPU from a generator seeded by ``--seed`` and the parameter's name, and each TP rank keeps its shard
as megatron lays it out (``linear_qkv`` whole query groups per rank, gated ``linear_fc1`` ``[gate_r; up_r]`` on
rank r). The global batch (``--batch`` sequences) is drawn on the CPU from ``--seed``; each DP rank takes its share.

Sizes (``--size``; ``--layers`` etc. override): ``tiny`` (CPU tests), ``small`` (issue 12: GPU BF16 vs CPU FP32),
``250m`` (issue 16: 12 layers, hidden 1024, 16 heads in 4 query groups, FFN 4096 gated, vocab 32000, seq 1024:
248M parameters; one sequence by default, since a full-tensor step of it is about 4 GB per rank before gzip).

Issue 12, part A (the CPU FP32 reference is a TP=2 capture made on the CPU with gloo):

    torchrun --standalone --nproc_per_node 2 examples/distributed/gpu_gpt.py --device cpu --dtype fp32 \\
        --size small --tp 2 --ddp none --capture .gpuref/ref_small_tp2.h5
    torchrun --standalone --nproc_per_node 1 examples/distributed/gpu_gpt.py --device cuda --dtype bf16 \\
        --size small --ddp none --capture gpu_bf16.h5                            # on the GPU, Float16Module
    tensordiff diff '.gpuref/ref_small_tp2.rank*.h5' gpu_bf16.h5

Issue 16, part B (two GPUs, NCCL, megatron DDP, BF16):

    torchrun --standalone --nproc_per_node 1 examples/distributed/gpu_gpt.py --size 250m --capture tp1.h5
    torchrun --standalone --nproc_per_node 2 examples/distributed/gpu_gpt.py --size 250m --tp 2 --capture tp2.h5
    tensordiff diff tp1.h5 'tp2.rank*.h5'                                                           # B1
    torchrun --standalone --nproc_per_node 2 examples/distributed/gpu_gpt.py --size 250m --dp 2 --batch 2 --grad-reduce fp32 \\
        --capture dp2fp32.h5
    torchrun --standalone --nproc_per_node 2 examples/distributed/gpu_gpt.py --size 250m --dp 2 --batch 2 --grad-reduce bf16 \\
        --capture dp2bf16.h5
    tensordiff diff 'dp2fp32.rank*.h5' 'dp2bf16.rank*.h5'                                           # B2
    torchrun --standalone --nproc_per_node 1 examples/distributed/gpu_gpt.py --size 250m --batch 4 --time 10 \\
        --report t_dp1.json                                                                          # B3: 1 GPU
    torchrun --standalone --nproc_per_node 2 examples/distributed/gpu_gpt.py --size 250m --batch 8 --dp 2 \\
        --time 10 --report t_dp2.json                                                                # B3: 2 GPUs

``--time N`` measures the step time (``torch.cuda.synchronize()`` before and after each step) over N steps
without capture, then N steps under a statistics-only capture (``tensors="none"``; its first step, which records
the weights, is a warm-up and not timed), then N steps without capture again; the medians go to ``--report``
(one JSON per rank, ``{rank}`` in the name or ``.rankN`` added). ``examples/distributed/gpu_runs.sh`` runs all of
it on a two-GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tensordiff

SIZES = {
    "tiny": dict(vocab=128, hidden=64, ffn=128, layers=2, heads=4, groups=2, seq=32, batch=4),
    "small": dict(vocab=512, hidden=128, ffn=352, layers=4, heads=8, groups=4, seq=64, batch=2),
    "250m": dict(vocab=32000, hidden=1024, ffn=4096, layers=12, heads=16, groups=4, seq=1024, batch=1),
    # issue 13 (performance): 134M and 1.03B parameters, seq 2048, micro-batch 2
    "125m": dict(vocab=32000, hidden=768, ffn=2048, layers=12, heads=12, groups=4, seq=2048, batch=2),
    "1b": dict(vocab=32000, hidden=2048, ffn=5632, layers=20, heads=16, groups=4, seq=2048, batch=2),
}
STD = 0.02


def build(args: argparse.Namespace) -> torch.nn.Module:
    """The GPTModel of this rank (its TP shard), parameters in FP32 (``Float16Module`` casts them to BF16)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cpu = args.device == "cpu"  # perform_initialization stays on: without it megatron sets no partition attributes
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_attention_heads=args.heads,
        num_query_groups=args.groups, use_cpu_initialization=cpu, init_method_std=STD,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, bf16=args.dtype == "bf16",
        normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, bias_activation_fusion=False, tensor_model_parallel_size=args.tp,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=args.vocab, max_sequence_length=args.seq, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope")
    if args.eps_layer is not None:  # a difference below every BF16 tolerance (same-stack exactness finds it)
        norm = model.decoder.layers[args.eps_layer].pre_mlp_layernorm
        norm.eps = 1e-3  # megatron-core config: 1e-6
    # megatron's own layers are made on the GPU; the local spec's torch norms (torch.nn.RMSNorm) on the CPU:
    # Megatron-LM moves the model with .cuda() after building it
    return model if cpu else model.cuda(torch.cuda.current_device())


def full_shape(name: str, args: argparse.Namespace) -> tuple[int, ...]:
    """The TP=1 shape of parameter ``name``."""
    hd = args.hidden // args.heads
    for suffix, shape in (
        ("embedding.word_embeddings.weight", (args.vocab, args.hidden)),
        ("output_layer.weight", (args.vocab, args.hidden)),
        ("layernorm.weight", (args.hidden,)),
        ("linear_qkv.weight", ((args.heads + 2 * args.groups) * hd, args.hidden)),
        ("linear_proj.weight", (args.hidden, args.heads * hd)),
        ("linear_fc1.weight", (2 * args.ffn, args.hidden)),
        ("linear_fc2.weight", (args.hidden, args.ffn)),
    ):
        if name.endswith(suffix):
            return shape
    raise KeyError(f"no full shape for parameter {name}")


def full_weight(name: str, args: argparse.Namespace) -> torch.Tensor:
    """The TP=1 weight ``name``: norms 1, the rest N(0, STD^2) from a CPU generator seeded by seed and name."""
    shape = full_shape(name, args)
    if name.endswith("layernorm.weight"):
        return torch.ones(shape)
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g) * STD


def shard(full: torch.Tensor, param: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's piece of ``full`` as megatron-core lays out ``param`` (mcore_train.py's shard, no faults)."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    if stride > 1:  # gated fc1: [gate; up] -> rank r holds [gate_r; up_r]
        return torch.cat([part.chunk(tp, dim=dim)[rank] for part in full.chunk(stride, dim=dim)], dim=dim)
    return full.chunk(tp, dim=dim)[rank]  # linear_qkv rows are per query group: whole groups per rank


def load_weights(model: torch.nn.Module, args: argparse.Namespace) -> None:
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            piece = shard(full_weight(name, args), param, args.tp, tp_rank)
            if piece.shape != param.shape:
                raise SystemExit(f"{name}: shard {tuple(piece.shape)} vs parameter {tuple(param.shape)}")
            param.copy_(piece)


def wrap(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """BF16: ``Float16Module`` (as Megatron-LM does); ``--ddp megatron``: megatron-core's DDP around it."""
    if args.dtype == "bf16":
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    if args.ddp == "megatron":
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        model = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.grad_reduce == "fp32", overlap_grad_reduce=False,
            use_distributed_optimizer=False), module=model)
    return model


def batch(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, ...]:
    """This DP rank's share of the global batch: tokens, labels, position ids and the causal mask."""
    from megatron.core import parallel_state

    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    if args.batch % dp:
        raise SystemExit(f"--batch {args.batch} does not split over DP {dp}")
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    local = ids.chunk(dp, dim=0)[dp_rank]
    tokens, labels = local[:, :-1].contiguous(), local[:, 1:].contiguous()
    position_ids = torch.arange(args.seq).unsqueeze(0).expand(tokens.shape[0], -1).contiguous()
    causal = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool), diagonal=1)[None, None]
    return tuple(t.to(device) for t in (tokens, labels, position_ids, causal))


class Trainer:
    """One training step: zero the DDP buffer, forward, backward, reduce, SGD step."""

    def __init__(self, model: torch.nn.Module, args: argparse.Namespace, data: tuple[torch.Tensor, ...]):
        self.model, self.args, self.data = model, args, data
        self.opt = torch.optim.SGD(model.parameters(), lr=args.lr)

    def step(self) -> torch.Tensor:
        tokens, labels, position_ids, causal = self.data
        megatron_ddp = self.args.ddp == "megatron"
        if megatron_ddp:
            self.model.zero_grad_buffer()  # megatron's train_step does this before each step
        loss = self.model(tokens, position_ids, causal, labels=labels).float().mean()
        loss.backward()
        if megatron_ddp:
            self.model.finish_grad_sync()
            for param in self.model.parameters():  # a copy: an alias would be accumulated into by the next backward
                param.grad = param.main_grad.to(param.dtype, copy=True)
        elif self.args.dp > 1:
            raise SystemExit("--dp > 1 needs --ddp megatron")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


HOST: dict[str, list[float]] = {}  # --time: the host's own time per step (before the closing sync), per phase


def timed(trainer: Trainer, n: int, device: torch.device, cap=None, phase: str = "") -> list[float]:
    out = []
    for _ in range(n):
        sync(device)
        t0 = time.perf_counter()
        loss = trainer.step()
        if cap is not None:
            cap.step(loss)
        t1 = time.perf_counter()
        sync(device)
        out.append(time.perf_counter() - t0)
        if phase:
            HOST.setdefault(phase, []).append(t1 - t0)
    return out


def kernel_profile(trainer: Trainer, device: torch.device, cap, path: str, mode: str = "w") -> None:
    """--kernels: the GPU time by kernel of one step (torch.profiler; captured when ``cap`` is given), to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed(trainer, 1, device, cap)
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events) / 1e3
    with open(path, mode) as f:
        f.write(f"== {'captured' if cap is not None else 'plain'} step: GPU kernel time {total:.1f} ms\n")
        f.write(events.table(sort_by="self_device_time_total", row_limit=25) + "\n")


def timing(trainer: Trainer, args: argparse.Namespace, device: torch.device, rank: int) -> None:
    """--time N: step times without capture, under a statistics-only capture, and without again (medians)."""
    for _ in range(args.warmup):
        trainer.step()
    sync(device)
    plain = timed(trainer, args.time, device, phase="plain")
    if args.kernels and rank == 0:
        kernel_profile(trainer, device, None, args.kernels)
    path = args.capture or f"/tmp/gpu_gpt_timing_{os.getpid()}.h5"
    t0 = time.perf_counter()
    with tensordiff.capture(trainer.model, path, steps=args.time + 6, optimizer=trainer.opt, tensors="none") as cap:
        first = timed(trainer, 1, device, cap)  # step 0 of the capture also records the weights' statistics
        captured = timed(trainer, args.time, device, cap, phase="captured")
        if args.kernels and rank == 0:
            kernel_profile(trainer, device, cap, args.kernels, "a")
        if args.profile and rank == 0:  # where the host time of a captured step goes (after the timed steps)
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            timed(trainer, 2, device, cap)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
            with open(args.profile, "w") as f:
                f.write(text.getvalue())
        t_close = time.perf_counter()
    close_s = time.perf_counter() - t_close
    total_capture_s = time.perf_counter() - t0
    after = timed(trainer, args.time, device)
    full: dict = {}
    if args.time_full:  # full tensors of one step, then statistics: does training wait on the copies or the writer?
        full_path = path.replace(".h5", "") + "_full.h5"
        t0 = time.perf_counter()
        with tensordiff.capture(trainer.model, full_path, steps=3, optimizer=trainer.opt, tensors="first") as cap:
            steps = timed(trainer, 1, device, cap)
            if os.environ.get("GPU_GPT_STACKS"):  # where every thread is, 3 s into the step after the full one
                import faulthandler

                faulthandler.dump_traceback_later(float(os.environ["GPU_GPT_STACKS"]), file=sys.stderr)
            steps += timed(trainer, 2, device, cap)
            t_close = time.perf_counter()
        full_file = tensordiff_rank_path(full_path)
        full = {"steps_s": steps, "close_s": time.perf_counter() - t_close, "total_s": time.perf_counter() - t0,
                "file_bytes": os.path.getsize(full_file) if os.path.exists(full_file) else None}
        if rank == 0 and os.path.exists(full_file):
            from tensordiff.store import CaptureFile

            with CaptureFile(full_file) as c:
                recs = c.records(0)
                full["records"] = len(recs)
                full["stored_records"] = sum(1 for r in recs if r.has_data and r.same_as < 0)
                full["tensor_bytes"] = sum(r.numel * (2 if r.dtype in ("bfloat16", "float16") else 4) for r in recs
                                           if r.has_data and r.same_as < 0)
                full["all_tensor_bytes"] = sum(r.numel * (2 if r.dtype in ("bfloat16", "float16") else 4)
                                               for r in recs if r.same_as < 0)
            os.remove(full_file)
    med = {k: statistics.median(v) for k, v in (("plain", plain), ("captured", captured), ("plain_after", after))}
    base = min(med["plain"], med["plain_after"])
    report = {
        "rank": rank, "world_size": dist.get_world_size(), "tp": args.tp, "dp": args.dp, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype, "ddp": args.ddp, "grad_reduce": args.grad_reduce,
        "micro_batch": args.batch // args.dp, "seq": args.seq, "layers": args.layers, "hidden": args.hidden,
        "params_local": sum(p.numel() for p in trainer.model.parameters()),
        "warmup_steps": args.warmup, "timed_steps": args.time,
        "median_s": med, "overhead_pct_vs_plain": 100 * (med["captured"] / med["plain"] - 1),
        "overhead_pct_vs_best_plain": 100 * (med["captured"] / base - 1),
        "capture_first_step_s": first[0], "capture_close_s": close_s, "capture_total_s": total_capture_s,
        "capture_file": tensordiff_rank_path(path),
        "capture_file_bytes": os.path.getsize(tensordiff_rank_path(path)) if os.path.exists(tensordiff_rank_path(path))
        else None,
        "steps_s": {"plain": plain, "captured": captured, "plain_after": after},
        "host_s": HOST,
        "full_tensors": full,
    }
    if args.report:
        out = tensordiff_rank_path(args.report)
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    host = {k: statistics.median(v) * 1e3 for k, v in HOST.items()}
    print(f"rank {rank}: host time per step (median, before the sync): "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in host.items()), flush=True)
    print(f"rank {rank}: step median plain {med['plain'] * 1e3:.1f} ms, stats-only capture {med['captured'] * 1e3:.1f} "
          f"ms ({report['overhead_pct_vs_plain']:+.1f}%), plain after {med['plain_after'] * 1e3:.1f} ms; capture's "
          f"first step {first[0] * 1e3:.1f} ms, close {close_s * 1e3:.1f} ms", flush=True)
    if full:
        print(f"rank {rank}: full tensors of step 0: steps {', '.join(f'{t * 1e3:.0f}' for t in full['steps_s'])} ms, "
              f"close {full['close_s']:.1f} s; file {(full['file_bytes'] or 0) / 1e9:.2f} GB; stored "
              f"{full.get('stored_records')} of {full.get('records')} records, {full.get('tensor_bytes', 0) / 1e9:.2f} "
              f"GB of {full.get('all_tensor_bytes', 0) / 1e9:.2f} GB", flush=True)


def tensordiff_rank_path(path: str) -> str:
    from tensordiff.capturing.options import rank_path

    return rank_path(path, dist.get_rank(), dist.get_world_size())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="250m")
    for key in ("vocab", "hidden", "ffn", "layers", "heads", "groups", "seq", "batch"):
        p.add_argument(f"--{key}", type=int, help=f"override the size's {key}" + (
            " (global batch in sequences, split over DP)" if key == "batch" else ""))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--ddp", choices=("megatron", "none"), default="megatron")
    p.add_argument("--grad-reduce", choices=("fp32", "bf16"), default="fp32",
                   help="megatron DDP's gradient buffer and all-reduce: grad_reduce_in_fp32 True (fp32) or False "
                        "(the parameters' dtype)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--eps-layer", type=int,
                   help="this layer's pre-MLP RMSNorm epsilon 1e-3 instead of 1e-6 (a fault below the BF16 tolerance)")
    p.add_argument("--tensors", choices=("first", "all", "none"), default="first")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--capture", help="capture file (one per rank: .rankN added)")
    p.add_argument("--time", type=int, default=0, help="measure step times over this many steps (see above)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--time-full", action="store_true",
                   help="--time: also capture one step's full tensors, then two steps of statistics (times, bytes)")
    p.add_argument("--report", help="--time: JSON report per rank")
    p.add_argument("--kernels", help="--time: GPU time by kernel of a plain and a captured step (torch.profiler), "
                                     "to this file")
    p.add_argument("--profile", help="--time: cProfile of two captured steps on rank 0, top 30 by own time, to this file")
    args = p.parse_args()
    for key, value in SIZES[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    from megatron.core import parallel_state, tensor_parallel

    if args.device == "cpu":
        from tensordiff.compat.megatron_cpu import enable

        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
        enable()
        device = torch.device("cpu")
        backend = "gloo"
    else:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        backend = "nccl"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank = dist.get_rank()
    if dist.get_world_size() != args.tp * args.dp:
        raise SystemExit(f"world size {dist.get_world_size()} is not --tp {args.tp} x --dp {args.dp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    if args.device == "cpu":
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed, inference_rng_tracker=True, force_reset_rng=True)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)

    t0 = time.perf_counter()
    model = build(args)
    load_weights(model, args)
    model = wrap(model, args)
    data = batch(args, device)
    trainer = Trainer(model, args, data)
    n_local = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"gpu_gpt {args.size}: layers {args.layers} hidden {args.hidden} seq {args.seq} global batch "
              f"{args.batch}, {n_local / 1e6:.1f}M parameters on rank 0, tp={args.tp} dp={args.dp} {args.dtype} "
              f"ddp={args.ddp} grad_reduce={args.grad_reduce} on {device}; built in {time.perf_counter() - t0:.1f} s",
              flush=True)
    if args.time:
        timing(trainer, args, device, rank)
    else:
        t0 = time.perf_counter()
        with tensordiff.capture(model, args.capture, steps=args.steps, optimizer=trainer.opt,
                                tensors=args.tensors) as cap:
            for step in range(args.steps):
                loss = trainer.step()
                cap.step(loss)
                if rank == 0:
                    print(f"gpu_gpt tp={args.tp} dp={args.dp} {args.dtype} step {step}: loss {loss.item():.6f}",
                          flush=True)
        if rank == 0:
            print(f"gpu_gpt: {args.steps} step(s) captured and written in {time.perf_counter() - t0:.1f} s",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
