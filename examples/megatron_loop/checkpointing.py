"""Checkpoints of the megatron-core loop (``train.py``) in Megatron-LM's directory layout, written and read through
megatron-core's public APIs:

    DIR/latest_checkpointed_iteration.txt          the last iteration saved
    DIR/iter_{J:07d}/                              --ckpt-format torch_dist: megatron-core's dist_checkpointing.save
        .metadata, __R_0.distcp, common.pt, metadata.json
    DIR/iter_{J:07d}/mp_rank_{tp:02d}[_{pp:03d}]/  --ckpt-format torch: one folder per model-parallel rank
        model_optim_rng.pt                         {"model", "optimizer", "opt_param_scheduler", "iteration", "args",
                                                    "checkpoint_version", "rng_state"} (torch.save)
        distrib_optim.pt                           the distributed optimizer's parameter state
                                                   (optimizer.save_parameter_state)

Loading restores the model, the optimizer (Adam's moments and step), the learning-rate scheduler and the iteration
(``--no-load-optim``, ``--no-load-rng``, ``--finetune`` as in Megatron-LM). Files are read with torch's safe loader
(``weights_only=True``, megatron-core's own allow-list of plain classes), never unpickled otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random

import numpy as np
import torch
import torch.distributed as dist

CHECKPOINT_VERSION = 3.0
TRACKER = "latest_checkpointed_iteration.txt"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's checkpoint and learning-rate flags (same names, same meaning as ``pretrain_gpt.py``)."""
    g = p.add_argument_group("checkpointing (as Megatron-LM)")
    g.add_argument("--save", metavar="DIR", help="save checkpoints here (iter_NNNNNNN folders and the tracker file)")
    g.add_argument("--save-interval", type=int, default=None, help="save every N iterations (and at the end)")
    g.add_argument("--load", metavar="DIR", help="resume from the tracker's iteration of this folder")
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the tracker's")
    g.add_argument("--ckpt-format", choices=("torch_dist", "torch"), default="torch_dist")
    g.add_argument("--dist-ckpt-optim-sharding", choices=("fully_reshardable", "dp_reshardable"),
                   default="fully_reshardable",
                   help="torch_dist: the distributed optimizer's state per parameter (fully_reshardable, what "
                        "Megatron-LM's --dist-ckpt-optim-fully-reshardable saves) or per gradient bucket "
                        "(dp_reshardable, Megatron-LM's default)")
    g.add_argument("--exit-interval", type=int, default=None, help="stop (saving if --save) when the iteration is a "
                                                                    "multiple of N")
    g.add_argument("--no-load-optim", action="store_true", help="do not load the optimizer (nor the scheduler)")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the RNG states")
    g.add_argument("--finetune", action="store_true", help="load the weights only; the iteration restarts at 0")
    s = p.add_argument_group("learning rate and weight decay (as Megatron-LM)")
    s.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on --load, keep this command's learning-rate and weight-decay schedule (default: it must "
                        "match the checkpoint's, as Megatron-LM asserts)")
    s.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on --load, take the schedule saved in the checkpoint")
    s.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant")
    s.add_argument("--lr-warmup-iters", type=int, default=0)
    s.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    s.add_argument("--min-lr", type=float, default=0.0)
    s.add_argument("--weight-decay", type=float, default=0.0)
    s.add_argument("--decay-norms", action="store_true",
                   help="a fault: weight decay on the 1-D parameters (norms, biases) too, which megatron-core exempts")


def megatron_lm_args(args: argparse.Namespace) -> None:
    """The model's and the run's settings under Megatron-LM's argument names, saved with each checkpoint as
    Megatron-LM saves its ``args`` (what a reader of the checkpoint needs to join shards and name parameters)."""
    from examples.distributed.mcore_train import FFN, GROUPS, HEADS, HIDDEN, LAYERS, SEQ, VOCAB

    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = args.tp, args.pp
    args.num_layers, args.hidden_size, args.ffn_hidden_size = LAYERS, HIDDEN, FFN
    args.num_attention_heads, args.num_query_groups, args.group_query_attention = HEADS, GROUPS, GROUPS != HEADS
    args.seq_length, args.padded_vocab_size, args.global_batch_size = SEQ, VOCAB, args.batch
    args.swiglu, args.normalization, args.position_embedding_type = True, "RMSNorm", "rope"
    args.transformer_impl = "local"  # megatron-core's local layer spec (no Transformer Engine)
    args.use_distributed_optimizer = not args.no_distributed_optimizer
    args.train_iters, args.weight_decay_incr_style = args.steps, "constant"


def scheduler(args: argparse.Namespace, optimizer):
    """megatron-core's ``OptimizerParamScheduler`` as Megatron-LM builds it: steps counted in samples (each iteration
    adds the global batch), the warm-up from 0, the decay over ``--lr-decay-iters`` (default ``--train-iters``)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = args.batch
    decay_iters = args.lr_decay_iters or max(args.steps, 1)  # --steps 0 (only --save-init) builds one too
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=decay_iters * gbs, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=max(args.steps, 1) * gbs, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler)


# ------------------------------------------------------------------------------------------------------ names
def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_dir(iter_dir: str) -> str:
    """``mp_rank_{tp:02d}`` (``_{pp:03d}`` added under pipeline parallelism), as Megatron-LM names it."""
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    return os.path.join(iter_dir, name)


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if state.get("rng_tracker_states"):
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _rng_sharded(state: dict | None):
    """The RNG state as one ``ShardedObject`` per (pipeline, tensor) rank, replicated over data parallelism."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    return ShardedObject("rng_state", [state], shape, offset, replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _parts(optimizer) -> list:
    """The megatron optimizers a ``ChainedOptimizer`` holds (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _init_adam_state(optimizer) -> None:
    """Adam's state allocated (zeros, step 0) before a first step, so that the distributed optimizer's
    ``sharded_state_dict(is_loading=True)`` can describe it (without Transformer Engine's or Apex's fused Adam it reads
    the step from the state); the loaded checkpoint then overwrites all of it."""
    for opt in _parts(optimizer):
        inner = opt.optimizer
        if not isinstance(inner, torch.optim.Adam):  # AdamW is an Adam
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}


@contextlib.contextmanager
def _adam_steps_aside(optimizer):
    """torch's Adam keeps ``step`` in each parameter's state; the distributed optimizer's loaders of the parameter state
    copy every state tensor of a parameter from the file, which holds no step (megatron-core reads it from the param
    groups, loaded before): the steps are set aside for the copy and put back after."""
    aside = []
    for opt in _parts(optimizer):
        inner = getattr(opt, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if "step" in state:
                aside.append((state, state.pop("step")))
    try:
        yield
    finally:
        for state, step in aside:
            state["step"] = step
    _own_steps(optimizer)


def _own_steps(optimizer) -> None:
    """The distributed optimizer's ``load_state_dict`` gives every parameter's state the same ``step`` tensor; torch's
    Adam increments it in place once per parameter, so each would count several steps per iteration (the bias
    correction then drifts): each parameter gets its own copy."""
    for opt in _parts(optimizer):
        inner = getattr(opt, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _load_distributed_param_state(optimizer, param_state, how: str) -> None:
    for opt in _parts(optimizer):
        with _adam_steps_aside(opt), torch.no_grad():  # the main parameters are views of the model's
            getattr(opt, how)(param_state)


def _sharded_state_dict(model, optimizer, args, iteration: int, sched, loading: bool, with_optim: bool,
                        with_rng: bool) -> dict:
    model_sd = model.module.sharded_state_dict()
    state = {"model": model_sd, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration, "args": args}
    if with_optim:
        # the distributed optimizer's state per parameter, shaped as the parameter ("fully_reshardable"), or per
        # gradient bucket ("dp_reshardable", Megatron-LM's default)
        metadata = {"distrib_optim_sharding_type": getattr(args, "dist_ckpt_optim_sharding", "fully_reshardable")}
        if loading:
            _init_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=metadata)
        state["opt_param_scheduler"] = sched.state_dict()
    if with_rng:
        state["rng_state"] = _rng_sharded(None if loading else rng_state())
    return state


# ------------------------------------------------------------------------------------------------------- save
def save(args: argparse.Namespace, iteration: int, model, optimizer, sched) -> None:
    """Iteration ``iteration`` of the run into ``args.save`` in ``args.ckpt_format``; the tracker file last."""
    from megatron.core import parallel_state as ps

    folder = iteration_dir(args.save, iteration)
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    if args.ckpt_format == "torch_dist":
        from megatron.core import dist_checkpointing

        dist_checkpointing.save(_sharded_state_dict(model, optimizer, args, iteration, sched, loading=False,
                                                    with_optim=True, with_rng=True), folder)
    else:
        mine = rank_dir(folder)
        distributed = any(hasattr(o, "save_parameter_state") for o in _parts(optimizer))
        if ps.get_data_parallel_rank() == 0:
            os.makedirs(mine, exist_ok=True)
        dist.barrier()
        if distributed:  # collective over DP: DP rank 0 writes the gathered parameter state
            optimizer.save_parameter_state(os.path.join(mine, "distrib_optim.pt"))
        if ps.get_data_parallel_rank() == 0:
            state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                     "model": model.state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
                     "opt_param_scheduler": sched.state_dict(), "rng_state": [rng_state()]}
            torch.save(state, os.path.join(mine, "model_optim_rng.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(args.save, TRACKER), "w", encoding="utf-8") as fh:
            fh.write(str(iteration))
        print(f"  successfully saved checkpoint from iteration {iteration:7d} to {args.save} "
              f"[ {args.ckpt_format} ]", flush=True)
    dist.barrier()


# ------------------------------------------------------------------------------------------------------- load
def _iteration_to_load(args: argparse.Namespace) -> int | None:
    if args.ckpt_step is not None:
        return args.ckpt_step
    tracker = os.path.join(args.load, TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker, encoding="utf-8") as fh:
        text = fh.read().strip()
    if not text.isdigit():
        raise SystemExit(f"{tracker}: holds {text!r}, not an iteration number; pass --ckpt-step")
    return int(text)


def _safe_load(path: str):
    """``torch.load`` with ``weights_only=True`` (megatron-core registers its plain classes as safe globals)."""
    import megatron.core  # noqa: F401  (its safe globals: argparse.Namespace, numpy's array reconstruction, ...)

    return torch.load(path, map_location="cpu", weights_only=True)


def load(args: argparse.Namespace, model, optimizer, sched) -> int:
    """Restore what ``args.load`` holds; returns the iteration to continue after (0: start from scratch)."""
    iteration = _iteration_to_load(args)
    if iteration is None:
        if dist.get_rank() == 0:
            print(f" WARNING: could not find the metadata file {os.path.join(args.load, TRACKER)}; "
                  "training from random initialization", flush=True)
        return 0
    folder = iteration_dir(args.load, iteration)
    if not os.path.isdir(folder):
        raise SystemExit(f"{folder}: no such checkpoint folder (--load {args.load}, iteration {iteration})")
    with_optim = not (args.finetune or args.no_load_optim)
    with_rng = not (args.finetune or args.no_load_rng)
    fmt = "torch_dist" if os.path.exists(os.path.join(folder, "metadata.json")) else "torch"
    if fmt == "torch_dist":
        from megatron.core import dist_checkpointing

        request = _sharded_state_dict(model, optimizer, args, iteration, sched, loading=True, with_optim=with_optim,
                                      with_rng=with_rng)
        state = dist_checkpointing.load(request, folder)
        model.module.load_state_dict(state["model"])
        if with_optim:
            optim = dict(state["optimizer"])
            param_state = optim.pop("param_state", None)
            kind = optim.pop("param_state_sharding_type", None)
            optimizer.load_state_dict(optim)  # the param groups and the step
            _own_steps(optimizer)
            if param_state is not None:  # the distributed optimizer's per-parameter state
                assert kind in ("fully_reshardable", "dp_reshardable"), kind
                _load_distributed_param_state(optimizer, param_state, f"load_parameter_state_from_{kind}")
            sched.load_state_dict(state["opt_param_scheduler"])
        if with_rng:
            rng = state["rng_state"]
            set_rng_state(rng[0] if isinstance(rng, list) else rng)
    else:
        mine = rank_dir(folder)
        state = _safe_load(os.path.join(mine, "model_optim_rng.pt"))
        model.module.load_state_dict(state["model"])
        if with_optim:
            optimizer.load_state_dict(state["optimizer"])
            _own_steps(optimizer)
            if any(hasattr(o, "load_parameter_state_from_dp_zero") for o in _parts(optimizer)):  # distributed
                from megatron.core import parallel_state as ps

                params = (_safe_load(os.path.join(mine, "distrib_optim.pt"))
                          if ps.get_data_parallel_rank() == 0 else None)
                _load_distributed_param_state(optimizer, params, "load_parameter_state_from_dp_zero")
            sched.load_state_dict(state["opt_param_scheduler"])
        if with_rng:
            set_rng_state(state["rng_state"][0])
    if not with_optim and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # the optimizer's main parameters from the loaded weights
    if dist.get_rank() == 0:
        print(f"  successfully loaded checkpoint from {args.load} [ t 0, p 0 ] at iteration "
              f"{0 if args.finetune else iteration} [ {fmt} ]", flush=True)
    return 0 if args.finetune else iteration
