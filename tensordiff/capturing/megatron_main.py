"""Run a megatron-core training program, unedited, with capture on: what ``tensordiff capture --megatron`` runs.

    tensordiff capture --megatron -o run.h5 --steps 2 -- torchrun --nproc-per-node 2 pretrain_gpt.py ARGS
    # runs: torchrun --nproc-per-node 2 -m tensordiff.capturing.megatron_main pretrain_gpt.py ARGS
    tensordiff capture --megatron -o run.h5 -- python train.py ARGS
    # runs: python -m tensordiff.capturing.megatron_main train.py ARGS

The program runs as ``__main__`` as under ``python SCRIPT`` (``auto_main``); ``MegatronCapture``
(``megatron.py``) records its first training iterations in every worker, each rank its file.
"""

from __future__ import annotations

from . import auto_main


def main(argv: list[str] | None = None, as_program: bool = False) -> None:
    from .megatron import MegatronCapture

    auto_main.main(argv, as_program=as_program, attach=MegatronCapture())


if __name__ == "__main__":
    main(as_program=True)
