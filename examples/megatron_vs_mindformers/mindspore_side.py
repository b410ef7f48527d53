"""The MindSpore side: a MindFormers model (or a hand-written MindSpore port) on the CPU, trained on the
shared batch, from the converted shared checkpoint, with capture on.

    python examples/megatron_vs_mindformers/mindspore_side.py --family llama --batch batch.h5 \\
        --load-ckpt init.ckpt --capture ms.h5

Models by ``--family`` (see spec.py): ``gpt2`` -> the hand-written port in ms_gpt.py; ``llama`` ->
MindFormers ``parallel_core`` ``GPTModel``; ``qwen3`` -> MindFormers ``TrainingQwen3ForCausalLM``;
``llama-legacy`` -> the legacy MindFormers ``LlamaForCausalLM``.
MindFormers runs on the CPU through ``tensordiff.compat.mindformers_cpu``. ``--fault`` injects one
of the mistakes listed in FAULTS. ``--graph`` runs MindSpore in GRAPH_MODE: capture then records through probes
compiled into the graph (tensordiff/capturing/mindspore/graph.py). ``--jit`` stays in PyNative and wraps the whole
train step (``value_and_grad`` and the update) in ``mindspore.jit``, captured with ``graph=True``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np

FAULTS: dict[str, str] = {
    "none": "no fault",
    "gelu-approx": "gpt2: MindSpore's default nn.GELU(approximate=True), the tanh form (Megatron: erf)",
    "ln-eps": "gpt2: MindSpore's default nn.LayerNorm epsilon 1e-7 (Megatron: 1e-5)",
    "split-with-size": "llama/qwen3: CPU helper without its SplitWithSize fix (MindSpore's wrong transpose gradient)",
    "fc1-unconverted": "llama/qwen3: Megatron's stacked [gate; up] linear_fc1 loaded into MLPInterleaved unconverted",
}


def _ms_gpt(spec: Any, fault: str, state: dict[str, np.ndarray]) -> tuple[Any, Callable]:
    from examples.megatron_vs_mindformers.ms_gpt import MSGPTConfig, build

    cfg = MSGPTConfig(num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
                      vocab_size=spec.vocab_size, seq_length=spec.seq_length, layernorm_epsilon=spec.layernorm_epsilon,
                      gelu_approximate=False)
    if fault == "gelu-approx":
        cfg.gelu_approximate = True
    elif fault == "ln-eps":
        cfg.layernorm_epsilon = 1e-7
    model = build(cfg, state)

    def loss_fn(b: dict) -> Any:
        return model(b["tokens"], b["position_ids"], b["attention_mask"], b["labels"], b["loss_mask"])

    return model, loss_fn


def _mindformers(spec: Any, fault: str, state: dict[str, np.ndarray], loss_mask: bool = True) -> tuple[Any, Callable]:
    from examples.megatron_vs_mindformers.mf_models import build_mindformers

    if fault == "fc1-unconverted":  # what an unconverted Megatron checkpoint holds: [gate; up] stacked
        from tensordiff.transforms import OPS

        state = {k: (OPS["deinterleave"](v, 0) if k.endswith("mlp.linear_fc1.weight") else v) for k, v in state.items()}
    return build_mindformers(spec, state, loss_mask=loss_mask)


def main(argv: list[str] | None = None) -> list[float]:
    from examples.megatron_vs_mindformers.spec import FAMILIES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="gpt2")
    p.add_argument("--batch", required=True, help="batch file written by tensordiff batch")
    p.add_argument("--load-ckpt", required=True, help="MindSpore checkpoint (.ckpt or .safetensors) converted with tensordiff "
                                                      "ckpt convert")
    p.add_argument("--fault", choices=sorted(FAULTS), default="none")
    p.add_argument("--train-steps", type=int, default=2)
    p.add_argument("--capture", help="capture file (tensordiff capture -o sets it instead)")
    p.add_argument("--capture-steps", type=int, default=2)
    p.add_argument("--graph", "--graph-mode", dest="graph", action="store_true",
                   help="run in GRAPH_MODE (capture records through probes compiled into the graph)")
    p.add_argument("--jit", action="store_true",
                   help="PyNative, the train step a mindspore.jit function (captured with graph=True: the probes)")
    p.add_argument("--no-loss-mask", action="store_true",
                   help="llama/qwen3: call the model with labels and no loss_mask= (it builds its own)")
    args = p.parse_args(argv)
    if args.graph and args.jit:
        p.error("--graph and --jit: one or the other (GRAPH_MODE, or a jit step run from PyNative)")
    spec = FAMILIES[args.family]

    import mindspore as ms

    import tensordiff
    from tensordiff.batch import load as load_batch
    from tensordiff.ckpt import load as load_checkpoint

    ms.set_context(mode=ms.GRAPH_MODE if args.graph else ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    ms.set_seed(0)
    state = load_checkpoint(args.load_ckpt)
    if args.family == "gpt2":
        if args.fault in ("split-with-size", "fc1-unconverted"):
            p.error(f"--fault {args.fault} applies to --family llama or qwen3")
        if args.no_loss_mask:
            p.error("--no-loss-mask applies to the MindFormers families (llama, llama-stacked, qwen3)")
        model, loss_fn = _ms_gpt(spec, args.fault, state)
    else:
        if args.fault in ("gelu-approx", "ln-eps"):
            p.error(f"--fault {args.fault} applies to --family gpt2")
        from tensordiff.compat import mindformers_cpu

        mindformers_cpu.init_mindformers_cpu(seed=0, use_legacy=args.family == "llama-legacy")
        if args.graph:  # init_mindformers_cpu sets PyNative
            ms.set_context(mode=ms.GRAPH_MODE)
        mindformers_cpu.enable(exclude=("split_with_size",) if args.fault == "split-with-size" else ())
        model, loss_fn = _mindformers(spec, args.fault, state, loss_mask=not args.no_loss_mask)
        if args.graph or args.jit:  # the Ascend-only primitives of the built model's cells become CPU composites
            mindformers_cpu.enable_graph(model)
    b = load_batch(args.batch, vocab_size=spec.vocab_size, framework="mindspore")
    opt = ms.nn.SGD(model.trainable_params(), learning_rate=spec.lr)
    def batch_loss(batch: dict) -> Any:  # a def, not a lambda: the graph compiler parses it; the batch an argument,
        return loss_fn(batch)           # as a data loader feeds it (a constant of the graph may be folded away)

    grad_fn = ms.value_and_grad(batch_loss, None, opt.parameters)

    def train_step(batch: dict) -> Any:  # --jit: the whole step compiled, value_and_grad and the update
        loss, grads = grad_fn(batch)
        opt(grads)
        return loss

    jit_step = ms.jit(train_step) if args.jit else None
    losses = []
    # a jit step run from PyNative: graph=True (PyNative's hooks cannot be compiled); else capture picks by the mode
    with tensordiff.capture(model, args.capture, steps=args.capture_steps, optimizer=opt,
                            graph=True if args.jit else None) as cap:
        for step in range(args.train_steps):
            if jit_step is not None:
                loss = jit_step(ms.mutable(b))
            else:
                loss, grads = grad_fn(ms.mutable(b))  # mutable: tensors of the graph, not constants folded in
                opt(grads)
            cap.step(loss)
            losses.append(float(loss))
            print(f"mindspore {args.family} step {step}: loss {float(loss):.6f}", flush=True)
    return losses


if __name__ == "__main__":
    # MindFormers writes its log folder (output/log) into the working folder as soon as it logs; run as a script,
    # this one only builds a model with it: its log goes to the temporary folder (LOG_MF_PATH set by the caller wins)
    os.environ.setdefault("LOG_MF_PATH", os.path.join(tempfile.gettempdir(), "tensordiff-mindformers-log"))
    from tensordiff.errors import TensordiffError

    try:
        main()
    except TensordiffError as err:
        print(f"tensordiff: error: {err}", file=sys.stderr)
        sys.exit(2)
