"""A training loop built the way Megatron-LM's is, on megatron-core's own parts, that does not call tensordiff:
megatron-core's schedule (``get_forward_backward_func``), its ``DistributedDataParallel`` and its distributed
optimizer (``get_megatron_optimizer``), a loss function that reports ``lm loss`` as ``[sum, tokens]``.

    python examples/megatron_loop/train.py --steps 3
    torchrun --standalone --nproc-per-node 2 examples/megatron_loop/train.py --tp 2
    tensordiff capture --megatron -o run.h5 --steps 2 -- torchrun --standalone --nproc-per-node 2 \\
        examples/megatron_loop/train.py --tp 2                  # every rank captured, no edit to the loop

``--data batch.h5`` trains every iteration on the batch of a ``tensordiff batch`` file (else random ids per
iteration); ``--save-init FILE`` writes the starting weights (the full TP=1 model, megatron-core names, safetensors)
for the other framework to convert; ``--optimizer sgd`` steps with megatron-core's SGD (no momentum) instead of Adam.

``--direct FILE`` captures the same run through ``tensordiff.capture(model, FILE, ...)`` instead (the reference
the launcher's capture is checked against). ``--microbatches M`` splits each rank's batch into M micro-batches
(the schedule accumulates their gradients). Runs on the CPU (gloo; the shims of ``tensordiff.compat.megatron_cpu``)
and on GPUs as it is. It prints each iteration as Megatron-LM's log does (``iteration N/T | learning rate: ... |
lm loss: ... | grad norm: ...``).

Checkpoints and the learning-rate schedule take Megatron-LM's flags (``checkpointing.py``)::

    python examples/megatron_loop/train.py --train-iters 6 --save ckpt --save-interval 3   # torch_dist (default)
    python examples/megatron_loop/train.py --train-iters 6 --load ckpt --ckpt-step 3       # iterations 4..6 again
    ... --ckpt-format torch | --exit-interval N | --no-load-optim | --no-load-rng | --finetune
    ... --lr-decay-style {constant,linear,cosine} --lr-warmup-iters N --lr-decay-iters N --min-lr X --weight-decay X
    ... --decay-norms      # a fault: weight decay on the norms and biases too (megatron-core exempts them)
    ... --save-wgrads-interval N       # Megatron-LM's parameter-gradient files under --save (grads.py)

The learning rate follows megatron-core's ``OptimizerParamScheduler`` (counted in samples, as Megatron-LM does); the
log shows the rate after the iteration's scheduler step, as Megatron-LM's does. A run resumed from iteration J prints
iterations J+1.. exactly as the uninterrupted run did (model, Adam's moments and step, scheduler, RNG restored).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from functools import partial

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist

from examples.distributed.mcore_train import SEQ, VOCAB, build, full_weights, shard, stage_layer_names
from examples.megatron_loop import checkpointing, grads


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Megatron-LM's way: the summed masked token losses, their count, and ``lm loss`` as ``[sum, tokens]``."""
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    total = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    report = torch.cat([total.clone().detach().view(1), tokens.clone().detach().float().view(1)])
    return total, tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, position_ids, causal = next(data_iterator)
    output = model(tokens, position_ids, causal, labels=labels)
    return output, partial(loss_func, loss_mask)


def micro_batches(args: argparse.Namespace, dp_rank: int, dp: int, step: int) -> list[tuple[torch.Tensor, ...]]:
    """This DP rank's micro-batches of iteration ``step`` (the global batch is the same for every layout)."""
    if args.data:
        from tensordiff.batch import load

        ids = load(args.data, vocab_size=VOCAB, framework="torch")["stream"]
    else:
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, VOCAB, (args.batch, SEQ + 1), generator=g)
    local = ids.chunk(dp, dim=0)[dp_rank]
    out = []
    for part in local.chunk(args.microbatches, dim=0):
        tokens, labels = part[:, :-1], part[:, 1:]
        loss_mask = torch.ones_like(labels, dtype=torch.float32)
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(tokens.shape[0], -1)
        causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
        out.append((tokens, labels, loss_mask, position_ids, causal))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (each builds its share of the layers)")
    p.add_argument("--steps", "--train-iters", dest="steps", type=int, default=3,
                   help="iterations to train (Megatron-LM's --train-iters); a resumed run continues up to it")
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences), split over DP")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping (0: none)")
    p.add_argument("--eps", type=float, default=1e-6, help="the RMSNorm epsilon (a fault: another value on one side)")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--adam-beta1", type=float, default=0.9)
    p.add_argument("--adam-beta2", type=float, default=0.999)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--data", metavar="BATCH", help="a tensordiff batch file: every iteration trains on it")
    p.add_argument("--save-init", metavar="FILE", help="write the starting weights here (safetensors, rank 0)")
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument("--dp-sum", action="store_true", help="a fault: the DP reduction sums the gradients (no 1/DP)")
    p.add_argument("--direct", metavar="FILE", help="capture through tensordiff.capture(model, FILE, ...) instead")
    p.add_argument("--direct-steps", type=int, default=2)
    checkpointing.add_arguments(p)
    grads.add_arguments(p)
    args = p.parse_args()
    checkpointing.megatron_lm_args(args)

    cpu = not torch.cuda.is_available()
    if cpu:
        from tensordiff.compat.megatron_cpu import enable, optimizer_cpu

        torch.set_num_threads(1)
        enable()
    else:
        optimizer_cpu = contextlib.nullcontext  # type: ignore[assignment]
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    backend = "gloo" if cpu else "nccl"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                             pipeline_model_parallel_size=args.pp)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed, inference_rng_tracker=cpu, force_reset_rng=True)

    with optimizer_cpu():  # a pipeline stage's embedding setup moves weights with .cuda() (CPU: left where they are)
        model = build(args.tp, args.seed, pp=args.pp)
    names = stage_layer_names(model)  # this stage's layers under their global numbers
    for layer in list(model.decoder.layers) + [model.decoder]:
        for norm in layer.modules():
            if hasattr(norm, "eps"):
                norm.eps = args.eps
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    full = full_weights(args.seed)
    if args.save_init and dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in full.items()}, args.save_init)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(names[name], full[names[name]], param, args.tp, tp_rank))
    if not cpu:
        model.cuda()
    distributed = not args.no_distributed_optimizer
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=distributed,
                                               grad_reduce_in_fp32=True)
    model = DistributedDataParallel(model.config, ddp_config, module=model)
    if args.dp_sum:  # megatron scales each bucket by 1/DP before it reduces with SUM: without it, a sum
        for group in model.bucket_groups:
            for bucket in group.buckets:
                bucket.gradient_scaling_factor = 1.0
    with optimizer_cpu():  # on the CPU: the optimizer allocates on "cuda" and checks for CUDA tensors
        config = OptimizerConfig(optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, adam_beta1=args.adam_beta1,
                                 adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                                 weight_decay=args.weight_decay, sgd_momentum=0.0,
                                 use_distributed_optimizer=distributed, clip_grad=args.clip, bf16=False, fp16=False)
        # megatron-core exempts 1-D parameters and biases from weight decay; --decay-norms (a fault): no exemption
        optimizer = get_megatron_optimizer(config, [model], config_overrides={} if args.decay_norms else None)
    sched = checkpointing.scheduler(args, optimizer)
    start = 0
    if args.load:
        with optimizer_cpu():  # on the CPU: the optimizer's state exchange moves tensors with .cuda()
            start = checkpointing.load(args, model, optimizer, sched)
    model.config.finalize_model_grads_func = finalize_model_grads  # the DDP reduction, as Megatron-LM sets it
    schedule = get_forward_backward_func()
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    device = "cpu" if cpu else "cuda"

    cap = None
    if args.direct:
        import tensordiff

        cap = tensordiff.capture(model, args.direct, steps=args.direct_steps)
    saved = None
    for step in range(start, args.steps):
        iteration = step + 1
        model.zero_grad_buffer()
        optimizer.zero_grad()
        data = [tuple(t.to(device) for t in mb) for mb in micro_batches(args, dp_rank, dp, step)]
        wgrads = args.save and grads.due(args.save_wgrads_interval, iteration)
        model.force_all_reduce = bool(wgrads)  # Megatron-LM's way: whole gradients on every rank for the wgrads
        with optimizer_cpu():
            reported = schedule(forward_step_func=forward_step, data_iterator=iter(data), model=[model],
                                num_microbatches=args.microbatches, seq_length=SEQ,
                                micro_batch_size=data[0][0].shape[0], forward_only=False)
            if wgrads:
                grads.write(args.save, "wgrads", iteration, grads.weight_grads(model.module))
            model.force_all_reduce = False
            _, grad_norm, _ = optimizer.step()
        used_lr = optimizer.param_groups[0]["lr"]
        sched.step(increment=args.batch)  # Megatron-LM counts the schedule in samples: the global batch
        lr = optimizer.param_groups[0]["lr"]  # the rate after the scheduler's step, as Megatron-LM logs it
        last = parallel_state.is_pipeline_last_stage()
        if last:  # the loss is known on the last pipeline stage
            total = torch.stack([r["lm loss"] for r in reported]).sum(dim=0)
            loss = total[0] / total[1]  # this rank's micro-batches (Megatron-LM also averages over DP for its log)
        else:
            loss = None
        if cap is not None:
            cap.step(loss, grad_norm=grad_norm, lr=used_lr)
        if last and dp_rank == 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
            print(f" iteration {iteration:8d}/{args.steps:8d} | learning rate: {lr:.6E} | lm loss: {loss.item():.6E} "
                  f"| grad norm: {grad_norm:.3f} |", flush=True)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            with optimizer_cpu():
                checkpointing.save(args, iteration, model, optimizer, sched)
            saved = iteration
        if args.exit_interval and iteration % args.exit_interval == 0:
            break
    else:
        iteration = max(start, args.steps)
    if args.save and saved != iteration and iteration > start:  # Megatron-LM saves the last iteration too
        with optimizer_cpu():
            checkpointing.save(args, iteration, model, optimizer, sched)
    if cap is not None:
        cap.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
