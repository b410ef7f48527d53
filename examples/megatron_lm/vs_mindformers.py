"""Megatron-LM's own ``pretrain_gpt.py`` (on a GPU) against the MindFormers Trainer (on the CPU), from one checkpoint,
on the very token ids Megatron-LM trained on (docs/launchers.md). Three steps, the middle one on the GPU machine:

    python examples/megatron_lm/vs_mindformers.py prepare --out DIR          # CPU: the starting weights
    MEGATRON_LM=/path/to/Megatron-LM bash examples/megatron_lm/vs_mindformers_gpu.sh DIR/ckpt DIR none norm-eps
    python examples/megatron_lm/vs_mindformers.py compare --out DIR          # CPU: the Trainer, then the diffs

``prepare`` writes ``init.safetensors`` (``examples/megatron_loop/train.py --save-init``: the tiny Llama of
examples/launchers, megatron-core names) and ``ckpt/``, the same weights as a Megatron-LM ``--ckpt-format torch``
release checkpoint (``release_ckpt.py``). The GPU script trains pretrain_gpt.py from ``ckpt/`` on mock data and
captures it (``megatron.h5``; ``megatron-FAULT.h5`` for a run with a fault on Megatron-LM's side). ``compare`` then
takes the rows that run trained on out of its capture (``tensordiff batch --from-capture``), converts the weights for
MindFormers (``tensordiff ckpt convert``), runs MindFormers' Trainer from a YAML (``examples/launchers/llama_tiny.yaml``
with ``pad_token_id: -1`` and one epoch over the rows) under ``tensordiff capture --mindformers``, and diffs every
Megatron-LM capture in DIR against it.

It prints every command it runs and each diff's exit code. Its own exit code: 0 when the clean pair agrees (diff exit
0) and every fault is found (diff exit 1), 1 otherwise, 2 when a step fails.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HEADS, GROUPS, VOCAB = 4, 2, 128

#: llama_tiny.yaml's lines changed for pretrain_gpt.py's data: Megatron-LM's mock data holds every id 0..127 (id 0
#: too) and pads with -1, so no id is padding (MindFormers' Llama masks tokens equal to pad_token_id in the attention
#: and the loss); each Trainer step takes the next 2 rows, as each Megatron-LM iteration takes the next 2 samples
YAML_CHANGES = (("pad_token_id: 0", "pad_token_id: -1"),
                ("epochs: 3                          # one step an epoch: every step trains on the same batch, as "
                 "Megatron's does", "epochs: 1                          # one pass over the rows: 2 a step, in order"))


def _shown(cmd: list[str]) -> str:
    return " ".join(shlex.quote(os.path.relpath(c, ROOT) if os.path.isabs(c) and c.startswith(ROOT) else c)
                    for c in cmd)


def _run(cmd: list[str], cwd: str, verbose: bool) -> int:
    print(f"$ {_shown(cmd)}", flush=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if verbose:
        return subprocess.call(cmd, env=env, cwd=cwd)
    proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():  # the frameworks' chatter stays out; what tensordiff says is shown
        if line.startswith(("tensordiff", "release_ckpt")) or "{ Epoch:" in line:
            print("  " + (line[line.index("{ Epoch:"):] if "{ Epoch:" in line else line.strip()), flush=True)
    if proc.returncode != 0:
        print(proc.stdout[-6000:], file=sys.stderr)
    return proc.returncode


def write_config(path: str) -> None:
    """examples/launchers/llama_tiny.yaml with YAML_CHANGES."""
    with open(os.path.join(ROOT, "examples", "launchers", "llama_tiny.yaml"), encoding="utf-8") as f:
        text = f.read()
    for line, changed in YAML_CHANGES:
        assert line in text, f"llama_tiny.yaml has no `{line}`"
        text = text.replace(line, changed)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def prepare(out: str, verbose: bool) -> int:
    py = sys.executable
    for cmd in ([py, os.path.join(ROOT, "examples", "megatron_loop", "train.py"), "--save-init", "init.safetensors",
                 "--steps", "0", "--batch", "2"],
                [py, os.path.join(HERE, "release_ckpt.py"), "init.safetensors", "ckpt"]):
        if _run(cmd, out, verbose) != 0:
            return 2
    print(f"next, on the GPU machine: MEGATRON_LM=... bash examples/megatron_lm/vs_mindformers_gpu.sh "
          f"{os.path.join(out, 'ckpt')} {out} none norm-eps rope-base", flush=True)
    return 0


def compare(out: str, verbose: bool, reuse: bool) -> int:
    py, td = sys.executable, [sys.executable, "-m", "tensordiff"]
    clean = os.path.join(out, "megatron.h5")
    if not os.path.exists(clean) or not os.path.exists(os.path.join(out, "init.safetensors")):
        print(f"vs_mindformers.py: {out} needs init.safetensors (prepare) and megatron.h5 (vs_mindformers_gpu.sh)",
              file=sys.stderr)
        return 2
    write_config(os.path.join(out, "llama_tiny.yaml"))
    steps = [
        td + ["batch", "--from-capture", "megatron.h5", "-o", "batch.h5", "--vocab", str(VOCAB), "--mindrecord",
              "batch.mindrecord"],
        td + ["ckpt", "convert", "init.safetensors", "init.ckpt", "--mapping", "mcore-mindformers-llama", "--to",
              "mindformers", "--var", f"heads={HEADS}", "--var", f"groups={GROUPS}"],
        td + ["capture", "--mindformers", "-o", "mindformers.h5", "--steps", "2", "--", py,
              os.path.join(ROOT, "examples", "launchers", "run_mindformer.py"), "--config",
              os.path.join(out, "llama_tiny.yaml")],
    ]
    if reuse and os.path.exists(os.path.join(out, "mindformers.h5")):
        print(f"vs_mindformers.py: --reuse: mindformers.h5 kept from the earlier run in {out}", flush=True)
        steps = []
    for name in ("batch.mindrecord", "batch.mindrecord.db"):  # MindRecord refuses to overwrite
        if steps and os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    for cmd in steps:
        code = _run(cmd, out, verbose)
        if code != 0:
            print(f"vs_mindformers.py: the step above failed with exit code {code}", file=sys.stderr)
            return 2
    faults = sorted(os.path.basename(p)[len("megatron-"):-len(".h5")]
                    for p in glob.glob(os.path.join(out, "megatron-*.h5")))
    ok = True
    for fault in ["none"] + faults:
        name = "megatron.h5" if fault == "none" else f"megatron-{fault}.h5"
        report = "report.json" if fault == "none" else f"report-{fault}.json"
        cmd = td + ["diff", name, "mindformers.h5", "--first-divergence", "--json", report]
        print(f"$ {_shown(cmd)}", flush=True)
        code = subprocess.call(cmd, cwd=out)
        expected = 0 if fault == "none" else 1
        print(f"vs_mindformers.py: {name} against mindformers.h5: exit {code} "
              f"({'as expected' if code == expected else f'expected {expected}'})", flush=True)
        ok = ok and code == expected
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("prepare", "compare"))
    p.add_argument("--out", default=os.path.join(ROOT, "out", "megatron_lm_vs_mindformers"), help="the folder")
    p.add_argument("--reuse", action="store_true", help="compare: keep mindformers.h5 from an earlier run")
    p.add_argument("--verbose", action="store_true", help="show the frameworks' own output")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    return prepare(out, args.verbose) if args.what == "prepare" else compare(out, args.verbose, args.reuse)


if __name__ == "__main__":
    sys.exit(main())
