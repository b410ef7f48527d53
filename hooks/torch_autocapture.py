"""Kept for old commands; `tensordiff capture --auto` is the way now:

    tensordiff capture --auto -o run.h5 --steps 2 -- python train.py --its --args

This shim runs the entry point that ships in the package (tensordiff/capturing/auto_main.py):

    tensordiff capture -o run.h5 --steps 2 -- python hooks/torch_autocapture.py train.py --its --args
"""

from tensordiff.capturing.auto_main import main

if __name__ == "__main__":
    main(as_program=True)
