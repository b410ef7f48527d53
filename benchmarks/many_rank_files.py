"""How fast tensordiff reads many rank files: `tensordiff check` and `tensordiff diff` of a TP x PP x DP run, against
the number of worker processes (or a Dask cluster), in rank files per second.

    python benchmarks/many_rank_files.py --layout 2x2x256 --workers 1 2          # 1,024 rank files
    python benchmarks/many_rank_files.py --layout 1x1x128 --workers 1 2 --dask 2 # + a Dask LocalCluster, 2 workers
    python benchmarks/many_rank_files.py --source 'other/run.rank*.h5' --dp 64     # from rank files you have

The rank files are made from one real capture of megatron-core (examples/distributed/mcore_train.py: two steps,
tensors of both; under torchrun with gloo when TP x PP > 1): each of its TP x PP rank files is copied to DP data-
parallel ranks, with the coordinates megatron gives them (rank = tp_rank + TP * (dp_rank + DP * pp_rank), its DP, TP
and PP groups). Every DP copy holds the same records, so the run is consistent (check: exit 0) and the diff of the
run against itself merges TP x DP files per pipeline stage on each side (exit 0). Prints one line per (command,
workers): wall seconds, rank files per second, exit code.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "distributed", "mcore_train.py")


def real_capture(folder: str, tp: int, pp: int) -> list[str]:
    """The rank files of one real megatron-core run of TP x PP ranks (a plain file when both are 1)."""
    out = os.path.join(folder, "src.h5")
    env = dict(os.environ, PYTHONPATH=ROOT)
    if tp * pp == 1:
        subprocess.run([sys.executable, TRAIN, "--capture", out], check=True, capture_output=True, env=env)
        return [out]
    groups = max(2, tp)  # TP must divide the query groups
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(tp * pp),
                    TRAIN, "--tp", str(tp), "--pp", str(pp), "--groups", str(groups), "--capture", out],
                   check=True, capture_output=True, env=env, cwd=folder)
    return sorted(glob.glob(os.path.join(folder, "src.rank*.h5")))


def spread_over_dp(sources: list[str], folder: str, dp: int) -> str:
    """Each source rank file copied to ``dp`` data-parallel ranks, with megatron's coordinates; the run's glob."""
    import h5py

    coords = []
    for path in sources:
        with h5py.File(path, "r") as f:
            raw = f.attrs.get("parallel")
            coords.append(json.loads(raw) if raw else {"tp": 1, "tp_rank": 0, "pp": 1, "pp_rank": 0})
    tp, pp = int(coords[0].get("tp", 1)), int(coords[0].get("pp", 1))
    world = tp * pp * dp
    rank_of = lambda t, d, p: t + tp * (d + dp * p)  # megatron's order: TP fastest, then DP, then PP
    for path, c in zip(sources, coords):
        t, p = int(c.get("tp_rank", 0)), int(c.get("pp_rank", 0))
        for d in range(dp):
            rank = rank_of(t, d, p)
            new = dict(c, world_size=world, rank=rank, dp=dp, dp_rank=d, source=c.get("source", "torch.distributed"),
                       dp_group=[rank_of(t, e, p) for e in range(dp)], tp_group=[rank_of(s, d, p) for s in range(tp)],
                       pp_group=[rank_of(t, d, q) for q in range(pp)], cp_group=[rank])
            dst = os.path.join(folder, f"run.rank{rank}.h5")
            shutil.copyfile(path, dst)
            with h5py.File(dst, "r+") as f:
                f.attrs["parallel"] = json.dumps(new, sort_keys=True)
                f.attrs["world_size"], f.attrs["rank"] = world, rank
    return os.path.join(folder, "run.rank*.h5")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", default="1x1x64", help="TPxPPxDP (default 1x1x64); TP x PP ranks are captured for real")
    p.add_argument("--source", help="a glob of rank files (or one file) to spread over --dp instead of a new capture")
    p.add_argument("--dp", type=int, help="with --source: the data-parallel size")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="--jobs values to measure")
    p.add_argument("--dask", type=int, nargs="*", default=[], help="also on a Dask LocalCluster of these many workers")
    p.add_argument("--commands", nargs="+", default=["check", "diff"], choices=("check", "diff"))
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="td-ranks-")
    try:
        t0 = time.perf_counter()
        if args.source:
            sources, dp = sorted(glob.glob(args.source)), args.dp or 64
        else:
            tp, pp, dp = (int(x) for x in args.layout.lower().split("x"))
            sources = real_capture(folder, tp, pp)
        pattern = spread_over_dp(sources, folder, dp)
        files = len(glob.glob(pattern))
        mb = sum(os.path.getsize(f) for f in glob.glob(pattern)) / 1e6
        print(f"{files} rank files ({len(sources)} real x DP {dp}), {mb:.0f} MB, made in {time.perf_counter() - t0:.1f} s",
              flush=True)
        settings = [("--jobs", str(w)) for w in args.workers]
        clusters = []
        for n in args.dask:
            from distributed import LocalCluster  # type: ignore[import-not-found,import-untyped,unused-ignore]

            cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None,
                                   env={"PYTHONPATH": ROOT})
            clusters.append(cluster)
            settings.append(("--dask", cluster.scheduler_address))
        for command in args.commands:
            argv = ["check", pattern] if command == "check" else ["diff", pattern, pattern, "--no-hints"]
            read = files if command == "check" else 2 * files
            for flag, value in settings:
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, "-m", "tensordiff", *argv, flag, value], capture_output=True,
                                      text=True, env=dict(os.environ, PYTHONPATH=ROOT))
                took = time.perf_counter() - t0
                shown = value if flag == "--jobs" else f"dask({args.dask[settings.index((flag, value)) - len(args.workers)]})"
                print(f"tensordiff {command:<5} {files} rank files, workers {shown:>8}: {took:7.2f} s, "
                      f"{read / took:6.1f} rank files/s, exit {proc.returncode}", flush=True)
                if proc.returncode not in (0, 1):
                    print(proc.stderr.strip()[-400:], flush=True)
        for cluster in clusters:
            cluster.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
