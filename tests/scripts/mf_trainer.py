"""A stand-in for MindFormers' run_mindformer.py (not in the wheel): ``--config x.yaml`` read into a MindFormerConfig,
``--register_path`` handled as run_mindformer.py does (``REGISTER_PATH`` and ``sys.path``), ``build_context``, then
``Trainer(args=config, ...).train()``, MindFormers' own Trainer. It passes the network (the YAML's legacy Llama, with
fixed initial weights) and the dataset (fixed token ids) so that two runs see the same numbers; the rest (wrapper,
optimizer, learning rate, callbacks) comes from the YAML.

``--hand FILE``: the same model, weights, batches and SGD step in a hand-written PyNative loop, captured directly
through ``tensordiff.capture(model, FILE, steps=2, optimizer=opt)`` (the reference).

After training it prints ``hooks left: N`` (forward hooks, tensordiff's cell classes) over the model's cells.
"""

import argparse
import os
import sys

import numpy as np

SAMPLES, BATCH, SEQ, VOCAB, LR = 6, 2, 16, 128, 0.01


def batches():
    return np.random.RandomState(0).randint(1, VOCAB, (SAMPLES, SEQ + 1)).astype(np.int32)


def build_model(config):
    """The YAML's LlamaForCausalLM with weights from a fixed seed (MindFormers' own init is not seeded alike)."""
    import mindspore as ms
    from mindformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in config.model.model_config.items() if k != "type"}
    model = LlamaForCausalLM(LlamaConfig(**fields))
    rs = np.random.RandomState(1)
    for p in model.get_parameters():
        shape = tuple(p.shape)
        value = np.ones(shape, np.float32) if len(shape) == 1 else (rs.randn(*shape) * 0.05).astype(np.float32)
        p.set_data(ms.Tensor(value))
    model.set_train(True)
    return model


def hand_loop(model, path, steps):
    import mindspore as ms

    import tensordiff

    opt = ms.nn.SGD(model.trainable_params(), learning_rate=LR)
    grad_fn = ms.value_and_grad(lambda ids: model(ids), None, opt.parameters)
    data = batches()
    with tensordiff.capture(model, path, steps=steps, optimizer=opt) as cap:
        for i in range(0, SAMPLES, BATCH):
            loss, grads = grad_fn(ms.Tensor(data[i:i + BATCH]))
            opt(grads)
            cap.step(loss)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--register_path", default=None)
    p.add_argument("--hand", default=None, help="capture a hand loop to this file instead of running the Trainer")
    args = p.parse_args()
    if args.register_path is not None:  # as run_mindformer.py does
        os.environ["REGISTER_PATH"] = args.register_path
        if args.register_path not in sys.path:
            sys.path.append(args.register_path)
    import mindspore.dataset as ds
    from mindformers import MindFormerConfig, Trainer
    from mindformers.core.context import build_context

    from tensordiff.compat.mindformers_cpu import hooks_left, register_cpu_wrapper

    config = MindFormerConfig(os.path.abspath(args.config))
    build_context(config)
    register_cpu_wrapper()
    model = build_model(config)
    if args.hand:
        hand_loop(model, args.hand, 2)
    else:
        dataset = ds.GeneratorDataset([(row,) for row in batches()], column_names=["input_ids"], shuffle=False)
        Trainer(args=config, model=model, train_dataset=dataset.batch(BATCH)).train()
    print(f"hooks left: {hooks_left(model)}", flush=True)


if __name__ == "__main__":
    main()
