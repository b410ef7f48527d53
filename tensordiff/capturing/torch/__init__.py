"""The PyTorch side of capture: everything that records a ``torch.nn.Module``'s steps.

* ``adapter``: ``TorchCapture`` (module, tensor and optimizer hooks installed and removed) and ``TorchTensors``
  (the ``TensorBackend`` for torch tensors);
* ``stats``: per-tensor statistics on the tensor's device, brought to the host once per step (``StatsCollector``);
  ``cuda_stats``: its CUDA kernel, compiled by NVRTC and launched through ctypes;
* ``copies``: full tensors staged on the device and moved to the host by a background thread (``HostCopier``);
* ``dp``: the parameter gradients before the data-parallel reduction (``LocalGrads``, kind ``grad_local``);
* ``parallel``: where a rank sits in a distributed run and how megatron splits its parameters.

Imported only where torch is (``tensordiff.capture`` with a torch module, ``--auto``, ``--megatron``).
"""
