"""Stage 1, capture: hooks that record a training run's tensors, step by step, into the store.

(A package named ``capturing`` so that it never shadows the ``tensordiff.capture()`` function.)

* ``options``: what to record (``CaptureOptions``), from arguments and the environment
  ``tensordiff capture`` sets; one file per rank;
* ``recorder``: ``Recorder``, the framework-free step bookkeeping (call indices, nesting,
  links for tensors seen before, gradients, the safety contract: a hook never raises into the
  model, a failure removes every hook and training goes on); ``NullCapture`` when capture is off;
  ``CaptureHandle``, what ``tensordiff.capture()`` returns, either way;
* ``signals``: SIGTERM / SIGHUP close the file with every step handed over, then do what they would have done;
* ``model_config``: the model's configuration fields that decide how two frameworks' tensors line up;
* ``backend``: ``TensorBackend``, the contract an adapter fulfils (read, copy, hook a tensor);
* ``torch/``, ``mindspore/``: one sub-package per framework, all of its capture in one place: the adapter
  (``TorchCapture``, ``MindSporeCapture``: hooks installed and removed, a backend each), and beside it what only
  that adapter uses (torch: device statistics, host copies, gradients before the data-parallel reduction, the
  parallel layout; MindSpore: graph-mode probes, the parallel layout); each names its modules;
* ``auto``: capture of a PyTorch program that does not call tensordiff, training steps only;
  ``auto_main``: its entry point (``python -m tensordiff.capturing.auto_main SCRIPT``, what
  ``tensordiff capture --auto`` runs);
* ``megatron``: a megatron-core training loop, unedited (its schedule and optimizer wrapped while the program runs);
  ``megatron_main``: its entry point (what ``tensordiff capture --megatron`` runs);
* ``mindformers_callback``: ``TensordiffCapture``, the MindSpore callback a MindFormers Trainer's YAML names;
  ``mindformers_register``: the folder MindFormers' ``auto_register`` imports it from;
* ``launch``: how ``tensordiff capture`` runs a program that does not call tensordiff: its command rewritten
  for ``--auto``, ``--megatron`` or ``--mindformers`` (``LAUNCHERS``, one entry each);
* ``startup``: the folder ``tensordiff capture`` puts first on the program's PYTHONPATH, whose ``sitecustomize``
  quiets the frameworks' start-up chatter (``--framework-logs`` keeps it).

Records go to ``tensordiff.store.CaptureWriter``. README.md here says how to add a framework or a launcher.
"""
