"""A stand-in for MindFormers' ``run_mindformer.py`` (in MindFormers' repository, not in its wheel), for the CPU.

    python examples/launchers/run_mindformer.py --config llama_tiny.yaml [--register_path DIR]

What run_mindformer.py does for ``run_mode: train``: the YAML (a relative ``--config`` is taken from the script's own
folder, as there) read into a ``MindFormerConfig``, ``--register_path``
made importable (``REGISTER_PATH``, ``sys.path``) for the YAML's ``auto_register`` entries, ``build_context``, then
MindFormers' own ``Trainer(config).train()``: the network, the dataset, the wrapper, the optimizer, the learning rate,
the checkpoint to load and the callbacks all come from the YAML. Additions for the CPU
(``tensordiff.compat.mindformers_cpu.trainer_on_cpu``): the wrapper ``CPUTrainOneStepCell`` (MindFormers' overflow
check has no CPU kernel) and, under msrun, a Barrier made of an AllReduce (the Barrier op has no CPU kernel either).
"""

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--register_path", default=None)
    args = p.parse_args()
    if args.register_path is not None:  # as run_mindformer.py does
        os.environ["REGISTER_PATH"] = args.register_path
        if args.register_path not in sys.path:
            sys.path.append(args.register_path)
    from mindformers import MindFormerConfig, Trainer
    from mindformers.core.context import build_context

    from tensordiff.compat.mindformers_cpu import trainer_on_cpu

    if not os.path.isabs(args.config):  # as run_mindformer.py does: relative to the script's own folder
        args.config = os.path.join(os.path.dirname(os.path.abspath(__file__)), args.config)
    config = MindFormerConfig(args.config)
    build_context(config)
    trainer_on_cpu()
    Trainer(args=config).train()


if __name__ == "__main__":
    main()
