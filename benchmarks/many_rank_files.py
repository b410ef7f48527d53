"""How long reading many rank files takes: `tensordiff check` and `tensordiff diff` of a DP=N run, one process
vs a process pool (tensordiff/store/fanout.py).

    python benchmarks/many_rank_files.py --ranks 64 --jobs 1 2

The rank files are made from one real capture (megatron-core, examples/distributed/mcore_train.py, TP=1, two
steps, statistics only after step 0): copied N times, each copy given the coordinates of one data-parallel rank
of an N-rank run. Every copy holds the same records, so the run is consistent (check: exit 0) and the diff of the
run against itself merges N files on each side (exit 0). Prints one line per (command, jobs): wall seconds, exit
code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_run(folder: str, ranks: int) -> tuple[str, str]:
    import h5py

    source = os.path.join(folder, "one.h5")
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "distributed", "mcore_train.py"), "--capture",
                    source], check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=ROOT))
    for rank in range(ranks):
        path = os.path.join(folder, f"run.rank{rank}.h5")
        shutil.copyfile(source, path)
        with h5py.File(path, "r+") as f:
            coords = json.loads(f.attrs["parallel"])
            coords.update(world_size=ranks, rank=rank, dp=ranks, dp_rank=rank, dp_group=list(range(ranks)))
            f.attrs["parallel"] = json.dumps(coords, sort_keys=True)
            f.attrs["world_size"], f.attrs["rank"] = ranks, rank
    return source, os.path.join(folder, "run.rank*.h5")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="td-ranks-")
    try:
        t0 = time.perf_counter()
        one, pattern = make_run(folder, args.ranks)
        print(f"{args.ranks} rank files of {os.path.getsize(one) / 1e6:.1f} MB made in {time.perf_counter() - t0:.1f} s")
        for command in (["check", pattern], ["diff", pattern, pattern, "--no-hints"]):
            for jobs in args.jobs:
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, "-m", "tensordiff", *command, "--jobs", str(jobs)],
                                      capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
                print(f"tensordiff {command[0]:<6} {args.ranks} rank files, --jobs {jobs}: "
                      f"{time.perf_counter() - t0:6.2f} s, exit {proc.returncode}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
