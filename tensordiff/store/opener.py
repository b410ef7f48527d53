"""``open_capture(path)``: what every reader calls. A capture file, or a glob (``'run.rank*.h5'``) naming the rank
files of one distributed run, read as one capture in the single-device space: ``MergedCapture`` (tensor and data
parallel, ``merged.py``), or ``PipelineCapture`` when the files are pipeline stages (``pipeline.py``). An msprobe dump
folder (or its ``dump.json``) is read as a capture too: ``MsprobeDump`` (``msprobe.py``), and so is a Megatron-LM
``--save`` folder holding ``--save-wgrads-interval`` / ``--save-dgrads-interval`` files: ``MegatronGradDump``
(``megatron_grads.py``)."""

from __future__ import annotations

import glob
import re

from ..errors import CaptureFileError
from .base import CaptureReader
from .fanout import open_files
from .megatron_grads import MegatronGradDump, is_megatron_grads
from .merged import MergedCapture
from .msprobe import MsprobeDump, is_msprobe_dump
from .pipeline import PipelineCapture, pipeline_stages
from .reader import CaptureFile

_GLOB = re.compile(r"[*?\[]")


def open_capture(path: str) -> CaptureReader:
    """A capture file, or the rank files a glob names merged into one (see the module docstring)."""
    if not _GLOB.search(path):
        if is_msprobe_dump(path):
            return MsprobeDump(path)  # msprobe's dump folder (or its dump.json), read as a capture
        if not path.endswith((".h5", ".hdf5")) and is_megatron_grads(path):
            return MegatronGradDump(path)  # Megatron-LM's wgrads/dgrads files, read as a capture
        return CaptureFile(path)
    paths = sorted(glob.glob(path))
    if not paths:
        raise CaptureFileError(f"{path}: no file matches; rank files are named RUN.rankN.h5 (check the pattern and "
                               "quote it so the shell does not expand it)")
    if len(paths) == 1:
        return CaptureFile(paths[0])
    opened = open_files(paths)  # each rank file opened once (in the workers, for many): the merge takes them over
    try:
        if pipeline_stages(list(opened.values())) > 1:
            return PipelineCapture(paths, path, opened)
        return MergedCapture(paths, path, opened=opened)
    except BaseException:
        for cap in opened.values():  # those the merge did not take (it closes its own on an error)
            cap.close()
        raise
