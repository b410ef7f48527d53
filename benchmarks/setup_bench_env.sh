#!/usr/bin/env bash
# The benchmark's own environment for benchmarks/vs_msprobe.py: tensordiff (editable, from this checkout) with
# torch and megatron-core as `make setup` pins them, plus msprobe (PyPI: mindstudio-probe), which the project's
# .venv never gets.
#
#   benchmarks/setup_bench_env.sh [VENV]        # default .venv-bench in the repository root (git-ignored)
#   .venv-bench/bin/python benchmarks/vs_msprobe.py
#
# Offline, on a machine whose Python already has torch (a GPU image): the wheels carried in DIR that the image
# lacks (megatron-core, mindstudio-probe and msprobe's imports) installed without dependencies into TARGET:
#
#   benchmarks/setup_bench_env.sh --wheels .whl [--target /tmp/bench-site]
#   PYTHONPATH=/tmp/bench-site python3 benchmarks/vs_msprobe.py --device cuda --size 125m
#
# PYTHON picks the interpreter (default python3). Run again to bring an existing environment up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ "${1:-}" = "--wheels" ]; then
  WHEELS=${2:?--wheels DIR}
  TARGET=/tmp/bench-site
  [ "${3:-}" = "--target" ] && TARGET=${4:?--target DIR}
  mkdir -p "$TARGET"
  # a wheel is installed only where its distribution is missing: the image's numpy, pandas, torch stay as they are
  missing=$("$PYTHON" - "$WHEELS" <<'PY'
import glob, importlib.metadata as md, os, re, sys
for whl in sorted(glob.glob(os.path.join(sys.argv[1], "*.whl"))):
    name = re.sub(r"[-_.]+", "-", os.path.basename(whl).split("-")[0]).lower()
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(whl)
PY
)
  if [ -n "$missing" ]; then
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$TARGET" $missing
  fi
  echo "installed into $TARGET: $(echo $missing | xargs -n1 basename 2>/dev/null | tr '\n' ' ')"
  PYTHONPATH=$TARGET${PYTHONPATH:+:$PYTHONPATH} PYTHONWARNINGS=ignore "$PYTHON" -c \
    "from msprobe.pytorch import PrecisionDebugger; import megatron.core; print('msprobe and megatron-core import')"
  exit 0
fi

VENV=${1:-.venv-bench}
MSPROBE=${MSPROBE:-mindstudio-probe==26.2.0}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY=$VENV/bin/python
$PY -m pip install -q --upgrade pip
# torch pinned as in the Makefile's setup: 2.13.0 is the CPU build here (an unpinned torch pulls CUDA)
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[megatron]"
# with the project's numpy pin: msprobe's requirements would otherwise pull numpy 2
$PY -m pip install -q "$MSPROBE" "numpy>=1.24,<2"
# the venv stays out of git without touching .gitignore: the repository's own exclude file
exclude=$(git rev-parse --git-common-dir)/info/exclude
grep -qxF "/$VENV/" "$exclude" 2>/dev/null || echo "/$VENV/" >> "$exclude"
PYTHONWARNINGS=ignore $PY - <<'PY'
import importlib.metadata as md

import megatron.core
import torch

import tensordiff

try:
    from msprobe.pytorch import PrecisionDebugger  # noqa: F401
    probe = f"msprobe {md.version('mindstudio-probe')}"
except Exception as err:  # the harness then skips msprobe's settings and says why
    probe = f"msprobe not importable ({type(err).__name__}: {err})"
print(f"bench env: torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"tensordiff {tensordiff.__version__} from {tensordiff.__file__}; {probe}")
PY
