"""Under torchrun (2 ranks, gloo, DP=2): the capture of local gradients leaves no trace and changes no number.

For each data-parallel reduction of examples/distributed/mcore_train.py (--ddp manual | megatron | torch, each with
and without the BF16 fault), the model is trained 3 steps twice from the same weights: once bare, once with
``tensordiff.capture(..., steps=1)``. Prints one JSON line per case: whether the weights after 3 steps are
bitwise equal, and what is left on the model after the capture (post-accumulate-grad hooks on the parameters,
wrappers on megatron's bucket groups beyond the program's own)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tensordiff  # noqa: E402
from examples.distributed import mcore_train as ex  # noqa: E402
from tensordiff.compat.megatron_cpu import enable  # noqa: E402


def train(args: argparse.Namespace, path: str | None) -> tuple[list[torch.Tensor], dict]:
    model = ex.build(1, args.seed)
    full = ex.full_weights(args.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(full[name])
    model = ex.wrap(model, args)
    own = {id(g): dict(g.__dict__) for g in getattr(model, "bucket_groups", [])}
    tokens, labels, position_ids, causal = ex.batch(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    cap = tensordiff.capture(model, path, steps=1, optimizer=opt) if path else None
    for _ in range(3):
        loss = model(tokens, position_ids, causal, labels=labels).float().mean()
        loss.backward()
        ex.reduce_grads(model, args)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cap is not None:
            cap.step(loss)
    left = {"post_accumulate_grad_hooks": sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
                                              for p in model.parameters()),
            "bucket_group_attrs": sum(g.__dict__.get("start_grad_sync") is not own[id(g)].get("start_grad_sync")
                                      for g in getattr(model, "bucket_groups", []))}
    if cap is not None:
        cap.close()
        from tensordiff.store import CaptureFile

        with CaptureFile(path.replace(".h5", f".rank{dist.get_rank()}.h5")) as written:  # type: ignore[union-attr]
            left["local_records"] = sum(r.kind == "grad_local" for r in written.records(0))
            left["steps"] = len(written.steps)
    return [p.detach().clone() for p in model.parameters()], left


def main() -> None:
    torch.set_num_threads(1)
    enable()
    from megatron.core import parallel_state, tensor_parallel

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True, force_reset_rng=True)
    folder = tempfile.mkdtemp() if dist.get_rank() == 0 else ""
    box = [folder]
    dist.broadcast_object_list(box, src=0)
    for ddp in ("manual", "megatron", "torch"):
        for fault in ("none", "bf16-allreduce"):
            args = argparse.Namespace(tp=1, dp=2, sp=False, pp=1, batch=4, seed=1234, lr=0.1, fault=fault, ddp=ddp)
            bare, _ = train(args, None)
            captured, left = train(args, os.path.join(box[0], f"{ddp}-{fault}.h5"))
            same = all(torch.equal(x, y) for x, y in zip(bare, captured))
            if dist.get_rank() == 0:
                print(json.dumps({"ddp": ddp, "fault": fault, "same_weights": same, **left}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
