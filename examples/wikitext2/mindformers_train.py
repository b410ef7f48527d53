"""Train MindFormers' GPTModel (parallel_core, GPT-2-shaped) on WikiText-2 (MindSpore CPU, FP32, PyNative),
from the shared checkpoint, with tensordiff on.

    python examples/wikitext2/mindformers_train.py --tokens tokens.h5 --load-ckpt init.ckpt \\
        --capture mindformers.h5

MindFormers' own log lines (``{ Epoch:[  1/  1], step:[    1/  300], loss: ...``, printed by its
``MFLossMonitor``) go to ``output/log/rank_0/info.log`` under the working folder, as in any MindFormers run.

The model is MindFormers 1.9's Megatron-style GPTModel with LayerNorm, GELU, learned absolute
positions (they reach the embedding only with ``use_eod_reset=True``), biases and tied embeddings;
the optimizer is MindFormers' own AdamW (run under ``mindspore.jit``: its PyNative form costs more
than the model's step here), with the per-step learning rates of common.py. MindFormers lacks some
CPU kernels: ``tensordiff.compat.mindformers_cpu`` supplies them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np

import tensordiff
from examples.wikitext2.common import Tokens, Train, decays, learning_rates, model_spec
from tensordiff.ckpt import load as read_checkpoint
from tensordiff.compat.mindformers_cpu import enable, init_mindformers_cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", required=True, help="written by prepare.py")
    p.add_argument("--steps", type=int, default=Train.steps)
    p.add_argument("--load-ckpt", required=True, help="the shared initial weights, converted to MindFormers names")
    p.add_argument("--capture", help="tensordiff capture file")
    args = p.parse_args(argv)
    t = Train(steps=args.steps)
    data = Tokens(args.tokens)
    spec = model_spec(data.vocab_size, data.seq_length, t.batch_size)

    init_mindformers_cpu(0)
    enable()
    import mindspore as ms
    from mindformers.core.optim import AdamW

    from examples.megatron_vs_mindformers.mf_models import gpt2_model, load_state

    model = gpt2_model(spec)
    model.set_train(True)
    load_state(model, {k: np.asarray(v) for k, v in read_checkpoint(args.load_ckpt).items()})
    params = model.trainable_params()
    lrs = learning_rates(t)
    opt = AdamW([{"params": [p for p in params if decays(p.name, p.ndim)], "weight_decay": t.weight_decay},
                 {"params": [p for p in params if not decays(p.name, p.ndim)], "weight_decay": 0.0}],
                learning_rate=lrs, betas=t.betas, eps=t.eps)
    weights = list(opt.parameters)  # the optimizer's (grouped) order: gradients come back in it
    seq = data.seq_length
    position_ids = ms.Tensor(np.tile(np.arange(seq, dtype=np.int32), (t.batch_size, 1)))
    loss_mask = ms.Tensor(np.ones((t.batch_size, seq), dtype=np.float32))

    def lm_loss(window: np.ndarray):
        ids = ms.Tensor(window[:, :-1].astype(np.int32))
        labels = ms.Tensor(window[:, 1:].astype(np.int32))
        # train mode returns (loss, mtp_loss, extra_loss, attention_loss); loss is the masked mean
        return model(ids, position_ids=position_ids, labels=labels, loss_mask=loss_mask)[0].reshape(())

    grad_fn = ms.value_and_grad(lm_loss, None, weights)

    @ms.jit
    def clip(grads):
        norm = ms.ops.sqrt(sum(ms.ops.sum(g * g) for g in grads))
        scale = ms.ops.minimum(t.clip_grad / (norm + 1e-6), 1.0)  # torch.nn.utils.clip_grad_norm_'s rule
        return norm, tuple(g * scale for g in grads)

    update = ms.jit(opt.construct)
    # MindFormers' own training log (MFLossMonitor, as its Trainer prints it): output/log/rank_0/info.log
    from mindformers.core.callback.callback import MFLossMonitor

    monitor = MFLossMonitor(learning_rate=lrs[0], per_print_times=1)
    sink = types.SimpleNamespace(dataset_sink_mode=True)
    started = time.time()
    with tensordiff.capture(model, args.capture, steps=1) as cap:
        for step in range(t.steps):
            t0 = time.time()
            loss, grads = grad_fn(data.batch(step, t.batch_size))
            grad_norm, grads = clip(ms.mutable(tuple(grads)))  # mutable: one compilation, not one per step
            cap.grads(grads, weights)
            update(ms.mutable(grads))
            cap.step(loss, grad_norm=grad_norm, lr=lrs[step])
            it = step + 1
            took, value = time.time() - t0, float(loss)
            monitor.learning_rate = lrs[step]
            monitor.print_output_info(sink, 1, 1, t.batch_size / took, it, t.steps, value, took * 1000, False, 1.0,
                                      (t.steps - it) * took, 100 * it / t.steps, np.array([float(grad_norm)]),
                                      np.array([value]), np.zeros(1), np.zeros(1), np.zeros(1))
            if it % t.eval_interval == 0 or it == t.steps:
                losses = [float(lm_loss(w)) for w in data.valid_batches(t.batch_size, t.eval_batches)]
                val = sum(losses) / len(losses)
                cap.log(val_loss=val)  # lands on the step just ended
                print(f"mindformers step {it}/{t.steps}: loss {value:.4f}, validation loss {val:.4f} "
                      f"({time.time() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
