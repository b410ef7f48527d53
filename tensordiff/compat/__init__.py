"""Optional shims that let third-party frameworks run on the CPU (megatron-core, MindFormers).

A one-way corner: nothing in compat imports tensordiff, and nothing in tensordiff imports compat
(the examples and tests do). Each shim is enabled and disabled explicitly and restores the exact
original objects (see each module's docstring).

* ``megatron_cpu``: megatron-core 0.16.1 on a CPU build of torch, without Transformer Engine or Apex;
* ``mindformers_cpu``: MindFormers 1.9 models on MindSpore 2.9's CPU (PyNative and graph mode, FP32).
"""
