"""The folder MindFormers' ``--register_path`` (``REGISTER_PATH``) names for ``auto_register``: it holds
``tensordiff_capture`` (the callback's module), which MindFormers copies into its module cache and imports.
``python -m tensordiff.capturing.mindformers_register`` (``__main__``) prints the folder. Light on purpose (no
MindSpore import): the launcher reads the names below."""

import os

#: this folder, for ``--register_path`` / ``REGISTER_PATH``
REGISTER_DIR = os.path.dirname(os.path.abspath(__file__))
#: the module file in it that an ``auto_register`` key names
REGISTER_MODULE = "tensordiff_capture"
#: the callback's name in MindFormers' registry (``type: TensordiffCapture``)
NAME = "TensordiffCapture"
