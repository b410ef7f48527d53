"""Stage 2, the store: the capture file format, the contract between the two halves of tensordiff.

* ``format``: the HDF5 layout (``/steps/NNNNNN/index`` rows, ``data/<seq>`` tensors, ``/scalars``);
* ``writer``: ``CaptureWriter``, fed by the recorder, writing off the training thread;
* ``reader``: ``CaptureFile``, a streaming reader (one tensor in memory at a time);
* ``merged``: ``open_capture(path)``: a file, or a glob of one distributed run's rank files merged on read
  (``MergedCapture``).

Needs numpy and h5py only. See docs/format.md.
"""

from .format import FORMAT_VERSION
from .merged import MergedCapture, open_capture
from .reader import CaptureFile
from .writer import CaptureWriter

#: The reader's earlier name (``tensordiff.store.Capture``), kept for scripts that use it.
Capture = CaptureFile

__all__ = ["FORMAT_VERSION", "Capture", "CaptureFile", "CaptureWriter", "MergedCapture", "open_capture"]
