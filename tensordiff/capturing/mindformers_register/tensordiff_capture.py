"""What MindFormers' ``auto_register: tensordiff_capture.TensordiffCapture`` loads (it copies this file into its
module cache, so the import is absolute): tensordiff's callback, which it then registers by its name."""
from tensordiff.capturing.mindformers_callback import TensordiffCapture

__all__ = ["TensordiffCapture"]
