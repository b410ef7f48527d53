"""Optional shims that let third-party frameworks run on the CPU (megatron-core, MindFormers).

A one-way corner: nothing in compat imports tensordiff, and nothing in tensordiff imports compat
(the examples and tests do). Each shim is enabled and disabled explicitly and restores the exact
original objects (see each module's docstring).
"""
