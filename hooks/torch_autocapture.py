"""Run a PyTorch training script with capture on, without editing it.

    tensordiff capture -o run.h5 --steps 2 -- python hooks/torch_autocapture.py train.py --its --args

The first module with parameters that runs is taken as the model; each optimizer.step()
ends a step. See tensordiff/capturing/auto.py.
"""

import os
import runpy
import sys

if len(sys.argv) < 2:
    sys.exit("usage: python hooks/torch_autocapture.py SCRIPT [ARGS...]")

from tensordiff.capturing.auto import AutoCapture

auto = AutoCapture()
if not auto.install():
    print("tensordiff: TENSORDIFF_OUTPUT is not set; running without capture "
          "(start it through `tensordiff capture -o FILE -- python hooks/torch_autocapture.py ...`)", file=sys.stderr)
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
try:
    runpy.run_path(script, run_name="__main__")
finally:
    auto.close()
