"""MindFormers GPTModel (Llama config) trained data-parallel under msrun on the CPU, with capture on every rank.

    msrun --worker_num 2 --local_worker_num 2 --master_port 8129 --join True --log_dir logs \\
        examples/distributed/ms_train.py --capture dp2.h5          # writes dp2.rank0.h5, dp2.rank1.h5
    python examples/distributed/ms_train.py --capture ref.h5        # one process: the reference
    tensordiff diff ref.h5 'dp2.rank*.h5'

Every run starts from the same weights (drawn from --seed by name, on every rank) and sees the same global batch
(--batch sequences); each data-parallel rank takes its share of it. Gradients are averaged over the ranks by
MindSpore's own ``nn.DistributedGradReducer`` (``--fault dp-sum``: summed instead). MindFormers runs on the CPU
through ``tensordiff.compat.mindformers_cpu``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np

FAULTS = {"none": "no fault", "dp-sum": "gradients summed over data-parallel ranks instead of averaged"}


def weights(model, seed: int) -> None:
    """The same weights on every rank and in the single-process run: norms 1, the rest N(0, 0.05), by name."""
    import mindspore as ms

    for param in model.get_parameters():
        if "norm" in param.name:
            value = np.ones(param.shape, np.float32)
        else:
            g = np.random.default_rng([seed, *param.name.encode()])
            value = (g.standard_normal(param.shape) * 0.05).astype(np.float32)
        param.set_data(ms.Tensor(value))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences), split over the ranks")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--capture", help="capture file (one per rank: .rankN added)")
    p.add_argument("--fault", choices=sorted(FAULTS), default="none")
    args = p.parse_args()

    import mindspore as ms

    import tensordiff
    from examples.megatron_vs_mindformers.mf_models import _parallel_core_gpt
    from examples.megatron_vs_mindformers.spec import FAMILIES
    from tensordiff.compat import mindformers_cpu

    mindformers_cpu.init_mindformers_cpu(seed=0)
    mindformers_cpu.enable()
    rank, world = 0, 1
    if "MS_WORKER_NUM" in os.environ or "RANK_SIZE" in os.environ:  # started by msrun
        from mindspore.communication import get_group_size, get_rank, init

        init()
        rank, world = get_rank(), get_group_size()
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                     device_num=world)
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} does not split over {world} ranks")
    spec = replace(FAMILIES["llama"], batch_size=args.batch)
    model = _parallel_core_gpt(spec, "rope", False, rotary_base=spec.rotary_base, normalization="RMSNorm",
                               gated_linear_unit=True, hidden_act="silu", add_bias_linear=False, pad_token_id=0,
                               data_parallel_size=world)
    model.set_train(True)
    weights(model, args.seed)

    g = np.random.default_rng(0)  # the global batch, then this rank's share
    stream = g.integers(0, spec.vocab_size, (args.batch, spec.seq_length + 1)).astype(np.int32)
    local = np.split(stream, world, axis=0)[rank]
    s = spec.seq_length
    causal = np.triu(np.ones((s, s), dtype=bool), 1)
    b = {"tokens": ms.Tensor(local[:, :-1]), "labels": ms.Tensor(local[:, 1:]),
         "loss_mask": ms.Tensor(np.ones((len(local), s), np.float32)),
         "attention_mask": ms.Tensor(np.broadcast_to(causal, (len(local), 1, s, s)).copy())}

    def loss_fn():
        out = model(b["tokens"], labels=b["labels"], attention_mask=b["attention_mask"], loss_mask=b["loss_mask"])
        return out[0].reshape(())

    opt = ms.nn.SGD(model.trainable_params(), learning_rate=spec.lr)
    grad_fn = ms.value_and_grad(loss_fn, None, opt.parameters)
    reducer = (ms.nn.DistributedGradReducer(opt.parameters, mean=args.fault != "dp-sum", degree=world)
               if world > 1 else None)
    with tensordiff.capture(model, args.capture, steps=args.steps, optimizer=opt) as cap:
        for step in range(args.steps):
            loss, grads = grad_fn()
            if reducer is not None:
                grads = reducer(grads)
            opt(grads)
            cap.step(loss)
            if rank == 0:
                print(f"mindformers dp={world} step {step}: loss {float(loss):.6f}", flush=True)


if __name__ == "__main__":
    # MindFormers writes its log folder (output/log) into the working folder as soon as it logs; run as a script,
    # this one only builds a model with it: its log goes to the temporary folder (LOG_MF_PATH set by the caller wins)
    os.environ.setdefault("LOG_MF_PATH", os.path.join(tempfile.gettempdir(), "tensordiff-mindformers-log"))
    main()
