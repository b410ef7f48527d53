"""Several runs of examples/distributed/mcore_train.py in one torchrun launch: the same processes and gloo process
group, megatron's parallel state set up and torn down for each run (as megatron-core's own tests do between cases).

    torchrun --standalone --nproc_per_node 2 tests/scripts/dist_runs.py "--dp 2 --capture dp2.h5" "--tp 2 --sp --capture sp2.h5"

Each argument is one run's options, exactly as mcore_train.py takes them; the runs go in order, each writing its own
capture files (one per rank). One launch instead of one per run: each launch costs every rank the import of torch
and megatron-core (seconds of CPU each), which is most of a run of this small model.
"""

from __future__ import annotations

import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch.distributed as dist  # noqa: E402

from examples.distributed import mcore_train as ex  # noqa: E402


def main() -> None:
    runs = [ex.parse(shlex.split(options)) for options in sys.argv[1:]]  # every run's options checked first
    ex.init_process_group()
    for args in runs:
        ex.run(args)
        dist.barrier()  # every rank's files closed before the next run starts
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
