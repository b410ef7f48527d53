"""The folder MindFormers' ``--register_path`` (``REGISTER_PATH``) names for ``auto_register``: it holds
``tensordiff_capture.py``, which MindFormers copies into its module cache and imports. ``python -m
tensordiff.capturing.mindformers_register`` prints the folder."""
