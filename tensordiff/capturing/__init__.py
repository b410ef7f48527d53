"""Stage 1, capture: hooks that record a training run's tensors, step by step, into the store.

(A package named ``capturing`` so that it never shadows the ``tensordiff.capture()`` function.)

* ``options``: what to record (``CaptureOptions``), from arguments and the environment
  ``tensordiff capture`` sets; one file per rank;
* ``recorder``: ``Recorder``, the framework-free step bookkeeping (call indices, nesting,
  links for tensors seen before, gradients, the safety contract: a hook never raises into the
  model, a failure removes every hook and training goes on); ``NullCapture`` when capture is off;
* ``backend``: ``TensorBackend``, the contract an adapter fulfils (read, copy, hook a tensor);
* ``torch``, ``mindspore``: the adapters (``TorchCapture``, ``MindSporeCapture``): hooks installed
  and removed, a backend each;
* ``auto``: capture of a PyTorch program that does not call tensordiff, training steps only;
  ``auto_main``: its entry point (``python -m tensordiff.capturing.auto_main SCRIPT``, what
  ``tensordiff capture --auto`` runs);
* ``launch``: how ``tensordiff capture`` runs a program that does not call tensordiff: its command rewritten
  for ``--auto``, ``--megatron`` or ``--mindformers`` (``LAUNCHERS``, one entry each);
* ``startup``: the folder ``tensordiff capture`` puts first on the program's PYTHONPATH, whose ``sitecustomize``
  quiets the frameworks' start-up chatter (``--framework-logs`` keeps it).

Records go to ``tensordiff.store.CaptureWriter``.
"""
