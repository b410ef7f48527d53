"""The MindSpore side of capture: everything that records a ``mindspore.nn.Cell``'s steps.

* ``adapter``: ``MindSporeCapture`` (cell, tensor and optimizer hooks in PyNative) and ``MindSporeTensors`` (the
  ``TensorBackend`` for MindSpore tensors);
* ``graph``: ``MindSporeGraphCapture``, GRAPH_MODE and ``mindspore.jit`` through probes compiled into the graph;
* ``parallel``: where a rank sits in a distributed run (msrun, mpirun).

The framework's own verbs (``dtype_name``, ``to_numpy``, checkpoints) stay in ``tensordiff.frameworks.mindspore``,
which ``ckpt`` and ``batch`` use too. Imported only where MindSpore is.
"""
