"""Stage 2, the store: the capture file format, the contract between the two halves of tensordiff.

* ``format``: the HDF5 layout (``/steps/NNNNNN/index`` rows, ``data/<seq>`` tensors, ``/scalars``);
* ``writer``: ``CaptureWriter``, fed by the recorder, writing off the training thread (``writer_process``: in a
  process of its own, so HDF5 and deflate never hold the training process's GIL; ``codec``: shuffle + deflate per
  chunk off HDF5's lock, for writing and reading; ``rows``: ``StepRows``, a step's records packed as the recorder
  hands them over);
* ``validate``: a capture file checked before the reader trusts it (attributes, steps, index rows, links);
* ``base``: ``CaptureReader``, the contract every reader below keeps (what the rest of tensordiff types against), and
  ``ReaderBase``, the defaults of the capabilities a reader lacks (one rank, no copies, no inconsistencies);
* ``plan``: ``Plan``, how a record's tensor is read as plain data (a file's record, rank files' records merged, a sum)
  that a worker process follows (``read_plan``);
* ``reader``: ``CaptureFile``, a streaming reader (one tensor in memory at a time);
* ``opener``: ``open_capture(path)``: a file, or a glob of one distributed run's rank files merged on read
  (``merged``: ``MergedCapture``, tensor and data parallel; ``pipeline``: ``PipelineCapture``, its stages joined;
  ``fanout``: many rank files opened and indexed in a pool of worker processes; ``splits/``: how a framework splits each
  record across tensor-parallel ranks, by module class, one YAML per framework);
* ``msprobe``: ``MsprobeDump``, msprobe's dumps read as captures (``torch_file``: a ``.pt`` tensor read without unpickling);
* ``megatron_grads``: ``MegatronGradDump``, Megatron-LM's ``--save-wgrads-interval`` / ``--save-dgrads-interval`` files.

Needs numpy and h5py only. See docs/format.md.
"""

from .base import CaptureReader, ReaderBase
from .format import FORMAT_VERSION
from .megatron_grads import MegatronGradDump
from .merged import MergedCapture
from .msprobe import MsprobeDump
from .opener import open_capture
from .pipeline import PipelineCapture
from .plan import Plan
from .reader import CaptureFile
from .writer import CaptureWriter

#: The reader's earlier name (``tensordiff.store.Capture``), kept for scripts that use it.
Capture = CaptureFile

__all__ = ["FORMAT_VERSION", "Capture", "CaptureFile", "CaptureReader", "CaptureWriter", "MegatronGradDump",
           "MergedCapture", "MsprobeDump", "PipelineCapture", "Plan", "ReaderBase", "open_capture"]
