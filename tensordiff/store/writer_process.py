"""The capture writer in a process of its own: HDF5 and deflate never hold the training process's GIL.

``CaptureWriter`` writes on threads of the training process. Training on a GPU calls into Python thousands of
times a step, and every call that releases the GIL (most torch ops do) waits to get it back from whichever writer
thread holds it inside h5py: measured on an H200 at 1B parameters, the step after a 13 GB full-tensor step took
8.0 s instead of 0.24 s. ``ProcessWriter`` keeps the same queue, policy and guarantees, but its thread only streams
each step through a pipe (``os.write`` releases the GIL) to ``python -m tensordiff.store.writer_process``, which
writes the file with an ordinary ``CaptureWriter``.

Frames on the pipe: 8 bytes of length, then JSON; a step's frame is followed by the raw bytes of the arrays it lists.
Nothing is pickled. The child ignores SIGINT, SIGTERM and SIGHUP and writes until the pipe closes: when the
training process dies, even by SIGKILL, the child still completes and closes the steps it has received.

The handover. ``submit`` (the training thread, at ``step()``) writes the step's records and statistics into the pipe
itself, with the full tensors taken in host memory (a CPU model's); it returns once they are there, so every step
whose ``step()`` returned is written whatever happens to the training process after it. Full tensors copied from a
GPU (still on their way, or arrived) follow from the writer's thread, in pieces of at most ``PIECE`` bytes (``array`` frames, then
``end``): training never waits for them, and the next step's handover waits for one piece at most. A step whose
tensors did not all arrive (the training process died first) is written with the ones that did; the others keep
their statistics (``has_data`` 0) and the step says how many were lost (``tensors_lost``), with one warning.
Per-step scalars are handed over as records are, by the calling thread: ``submit_scalars`` returns once they are in
the pipe.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import select
import signal
import struct
import subprocess
import sys
import threading
from typing import IO, Any, BinaryIO

import numpy as np

from .. import _progress as progress
from .. import dtypes
from .._warn import warn as _warn
from .rows import StepRows, without_data
from .writer import CaptureWriter, Rows

_LEN = struct.Struct("<Q")
PIECE = 32 << 20  # bytes of a tensor per frame, streamed after its step's records
#: Tensors of at least this many bytes cross in shared memory (a file in ``SHM_DIR`` the child maps, then unlinks)
#: instead of the pipe: one copy in this process, none in the child (the pipe: ~2 GB/s, and a copy on each side);
#: while a quarter of ``SHM_DIR`` (at most ``SHM_KEEP_FREE``) stays free (else the pipe, which holds a writer that
#: falls behind to its pace).
SHM_MIN = 1 << 20
SHM_DIR = "/dev/shm"
SHM_KEEP_FREE = 4 << 30
SHM_ENV = "TENSORDIFF_WRITER_SHM"  # 0: every tensor through the pipe
SMALL_BYTES = 1 << 20  # a step's tensors from a GPU up to this size never wait for room in the queue
START_ENV = "TENSORDIFF_WRITER_START_TIMEOUT"  # seconds the child has to open the file (default 60; 0: never the child)
_READY = b"ready\n"


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _frame(obj: dict[str, Any], encoded: dict[str, bytes] | None = None) -> bytes:
    """``obj`` as a frame: its JSON's length, then its JSON; ``encoded``: more fields, their values JSON already."""
    body = json.dumps(obj, default=_jsonable).encode("utf-8")
    if encoded:
        body = body[:-1] + b"".join(b", " + json.dumps(key).encode() + b": " + value for key, value in encoded.items()) + b"}"
    return _LEN.pack(len(body)) + body


class ProcessWriter(CaptureWriter):
    """``CaptureWriter``'s interface and queue; the file is written by a child process."""

    def _open(self, attrs: dict[str, Any]) -> None:
        # a path that cannot be written is said here, in the training process, before any step (the child would only
        # find it out of sight)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "wb"):
            pass
        self._fallback = False
        self._attrs = attrs
        self._shm = _shm_usable()
        self._shm_count = 0
        # one frame at a time in the pipe: steps from the writer's thread, scalars from the threads that log them
        self._pipe_lock = threading.Lock()
        self._early: list[tuple[int, dict[str, float]]] = []  # scalars sent before the child answered
        self._waiting = self._start(attrs)  # its answer is read before the first write (training goes on meanwhile)

    def _ready(self) -> None:
        """Before the first write: wait until the child has opened the file. If it never does, no step may be lost
        to it: this process writes the file itself, starting with the scalars sent into the pipe meanwhile."""
        if self._waiting is None:
            return
        why = self._answer(self._waiting)  # not under the lock: scalars go on into the pipe while the child starts
        with self._pipe_lock:
            self._waiting = None
            early, self._early = self._early, []
            if not why:
                return
            _warn(f"tensordiff: the writer process for {self.path} did not start ({why}); writing from a thread of "
                  "the training process instead")
            self._fallback = True
            CaptureWriter._open(self, self._attrs)
            for step, values in early:
                CaptureWriter._write_scalars(self, step, values)

    def _start(self, attrs: dict[str, Any]) -> str | None:
        """Start the child and send it the file to open; the reason it could not start, or None."""
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root,
                                                                         os.environ.get("PYTHONPATH", "")])))
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "tensordiff.store.writer_process"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, env=env)
        except OSError as err:
            return f"{sys.executable}: {err.strerror or err}"
        assert self._proc.stdin is not None
        self._pipe: IO[bytes] = self._proc.stdin
        _widen(self._pipe.fileno())
        try:
            self._pipe.write(_frame({"t": "open", "path": self.path, "attrs": attrs, "threads": self.threads,
                                     "compression": self.compression}))
            self._pipe.flush()
        except OSError as err:
            return f"its pipe: {err.strerror or err}"
        return ""

    def _answer(self, why: str) -> str:
        """'' once the child says the file is open, else why it did not (within TENSORDIFF_WRITER_START_TIMEOUT)."""
        if why:
            return why
        try:
            timeout = float(os.environ.get(START_ENV) or 60.0)
        except ValueError:
            timeout = 60.0
        assert self._proc.stdout is not None
        answered = True  # something came (the answer, or the end of the pipe), or reading failed
        try:
            # a timeout of 0 or less: never the child (this process writes the file; what the tests use)
            ready, _, _ = select.select([self._proc.stdout], [], [], timeout) if timeout > 0 else ([], [], [])
            answered = bool(ready)
            answer = os.read(self._proc.stdout.fileno(), len(_READY)) if ready else b""
        except OSError:
            answer = b""
        self._proc.stdout.close()
        if answer == _READY:
            return ""
        self._proc.kill()
        code = self._proc.wait()
        return f"it ended with exit code {code}" if answered else f"no answer in {timeout:g} s"

    def _to_shm(self, raw: np.ndarray) -> str:
        """``raw`` written into a new file in ``SHM_DIR`` (its path), or '' where it goes through the pipe: small,
        shared memory off or full (then off for the rest of the run)."""
        if not self._shm or raw.nbytes < SHM_MIN:
            return ""
        try:  # the pipe throttles a writer that falls behind, shared memory does not: leave some of it free
            st = os.statvfs(SHM_DIR)
            if st.f_bavail * st.f_frsize < raw.nbytes + min(st.f_blocks * st.f_frsize // 4, SHM_KEEP_FREE):
                return ""
        except OSError:
            return ""
        self._shm_count += 1
        path = os.path.join(SHM_DIR, f"tensordiff-{os.getpid()}-{id(self):x}-{self._shm_count}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            self._shm = False
            return ""
        try:
            # the blocks first: a full tmpfs is an error here, never a SIGBUS in a mapping
            os.posix_fallocate(fd, 0, raw.nbytes)
            view = raw.reshape(-1).view(np.uint8).data
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:done + PIECE], done)  # GIL released while the kernel copies
        except OSError:
            self._shm = False
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return ""
        os.close(fd)
        return path

    def _sweep_shm(self) -> None:
        """The files the child did not take (it ended early): removed (the child unlinks each one it maps)."""
        prefix = f"tensordiff-{os.getpid()}-{id(self):x}-"
        with contextlib.suppress(OSError):
            for name in os.listdir(SHM_DIR):
                if name.startswith(prefix):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(SHM_DIR, name))

    def _close_file(self) -> None:
        self._ready()
        if self._fallback:
            CaptureWriter._close_file(self)
            return
        with self._pipe_lock:
            try:
                self._pipe.write(_frame({"t": "close"}))
                self._pipe.close()
            except OSError:
                pass
        try:
            with progress.task(f"tensordiff: the writer process finishes {os.path.basename(self.path)}"):
                code = self._proc.wait(60.0)  # the child finishes what it received, even after this process is gone
        except subprocess.TimeoutExpired:
            return
        if self._shm_count:
            self._sweep_shm()
        if code != 0 and self.error is None:

            _warn(f"tensordiff: the writer process of {self.path} ended with exit code {code}; the steps "
                          "it completed are in the file")

    def submit_scalars(self, step: int, values: dict[str, float]) -> None:
        """Hand per-step scalars over as a step is: the calling thread writes them into the pipe and returns once
        they are there, so a SIGKILL after it loses none. They never wait for the child to start (the pipe holds them
        until it reads; a child that never answers is replaced by a thread writer, which writes them). A step being
        streamed to the child is finished first (one frame at a time)."""
        if self.error is not None or self._closed:
            return
        # a SIGTERM arriving meanwhile waits until the frame is whole (signals.py)
        with self._holding(), self._pipe_lock:
            if not self._fallback:
                self._write_guarded(("scalars", step, values))  # errors: as a step's (one warning, capture stops)
                return
        CaptureWriter.submit_scalars(self, step, values)  # the thread writer that replaced the child: its queue

    def _write_scalars(self, step: int, values: dict[str, float]) -> None:
        if self._fallback:  # from the queue of the thread writer that replaced the child, on its thread
            CaptureWriter._write_scalars(self, step, values)
            return
        # the calling thread, holding the pipe's lock
        if self._waiting is not None:  # the child has not answered: kept until it has, for the writer replacing it
            self._early.append((step, values))
            if self._waiting:  # it never started: nothing to send them to
                return
            with contextlib.suppress(OSError):  # it has ended: its answer says so, and the writer replacing it writes them
                self._send(_frame({"t": "scalars", "step": step, "values": values}))
            return
        if self._pipe.closed:  # logged from another thread while the file was closed
            return
        self._send(_frame({"t": "scalars", "step": step, "values": values}))

    def _send(self, frame: bytes) -> None:
        self._pipe.write(frame)
        self._pipe.flush()

    def prepare(self, rows: Rows) -> None:
        if isinstance(rows, StepRows):
            rows.texts_json()

    def submit(self, step: int, rows: Rows, data: dict[int, Any], attrs: dict[str, Any]) -> None:
        """The step's records, statistics and host-side tensors into the pipe now (this thread); tensors copied from an
        accelerator (``ready()`` false) to the writer's thread, which streams them after."""
        if self.error is not None or self._closed:
            return
        self._ready()
        if self._fallback:
            CaptureWriter.submit(self, step, rows, data, attrs)
            return
        under_way = {seq: a for seq, a in data.items() if not _is_ready(a)}
        now = {seq: a for seq, a in data.items() if seq not in under_way}
        nbytes = sum(int(a.nbytes) for a in under_way.values())
        with self._holding():  # the queue bounds the bytes under way (the drop policy takes them out of the step)
            if nbytes <= SMALL_BYTES:  # a loss value: never waits behind a full step's tensors (the bound is for memory)
                later, behind = under_way, 0
            else:
                rows, later, attrs, nbytes, behind = self._admit(step, rows, under_way, attrs, nbytes)
            if self.error is not None:
                return
            with self._pipe_lock:
                self._write_guarded((step, rows, {"now": now, "later": list(later)}, attrs))
            if later and self.error is None:
                self._enqueue((step, None, later, {}, nbytes))
        self._said_dropped(step, behind)

    def _write(self, step: int, rows: Rows | None, data: dict[Any, Any], attrs: dict[str, Any]) -> None:
        if self._fallback:
            CaptureWriter._write(self, step, rows, data, attrs)  # type: ignore[arg-type]
            return
        if rows is not None:  # the step itself: the calling thread, holding the pipe's lock
            arrays = [(seq, _raw(array)) for seq, array in data["now"].items()]
            # this runs on the training thread: the rows' text fields as JSON lists, their numbers as one float64
            # array after the frame (JSON's float formatting was most of the cost); the recorder packs them itself
            packed = rows if isinstance(rows, StepRows) else StepRows.pack(rows)
            if packed is not None:
                arrays.insert(0, (-1, packed.table))  # sent as the step's array -1
            shared = {seq: self._to_shm(raw) for seq, raw in arrays if seq >= 0}
            head = {"t": "step", "step": step, "attrs": attrs, "later": data["later"],
                    "arrays": [[seq, raw.dtype.str, list(raw.shape)] + ([shared[seq]] if shared.get(seq) else [])
                               for seq, raw in arrays]}
            if packed is None:  # rows of another shape, sent as they are
                head["rows"] = rows
                self._pipe.write(_frame(head))
            else:
                head.update(fields=packed.fields, text_fields=packed.text_fields, number_fields=packed.number_fields)
                self._pipe.write(_frame(head, {"rows": packed.texts_json()}))
            for seq, raw in arrays:
                if raw.nbytes and not shared.get(seq):
                    self._pipe.write(raw.reshape(-1).view(np.uint8).data)  # released GIL while the pipe takes it
            self._pipe.flush()
        else:  # its tensors that were still on their way to the host: the writer's thread, a piece at a time
            for seq, array in data.items():
                raw = _raw(array)
                path = self._to_shm(raw)  # outside the lock: scalars and the next step's records go on meanwhile
                if path:
                    with self._pipe_lock:
                        self._send(_frame({"t": "shm", "step": step, "seq": seq, "dtype": raw.dtype.str,
                                           "shape": list(raw.shape), "path": path}))
                    continue
                flat = raw.reshape(-1).view(np.uint8)
                for start in range(0, max(flat.nbytes, 1), PIECE):
                    piece = flat[start:start + PIECE]
                    with self._pipe_lock:
                        self._pipe.write(_frame({"t": "array", "step": step, "seq": seq, "dtype": raw.dtype.str,
                                                 "shape": list(raw.shape), "at": start, "n": int(piece.nbytes)}))
                        if piece.nbytes:
                            self._pipe.write(piece.data)
                        self._pipe.flush()
            with self._pipe_lock:
                self._send(_frame({"t": "end", "step": step}))
        if self._proc.poll() is not None:
            raise OSError(f"the writer process ended (exit code {self._proc.returncode})")


def _unpack_rows(msg: dict[str, Any], table: np.ndarray | None) -> list[dict[str, Any]]:
    if table is None:  # rows of another shape, sent as they are
        return list(msg["rows"])
    return StepRows(msg["fields"], msg["text_fields"], msg["rows"], msg["number_fields"], table).dicts()


def _is_ready(array: Any) -> bool:
    """Whether a step's array is on the host (a ``Deferred`` copy may still be under way)."""
    if not callable(array):
        return True
    ready = getattr(array, "ready", None)
    return ready is None or bool(ready())


def _raw(array: Any) -> np.ndarray:
    if callable(array):  # a copy on its way to the host (capturing/recorder.py Deferred): waits for it
        array = array()
    return dtypes.to_storage(np.ascontiguousarray(array))[0]


def _shm_usable() -> bool:
    """Shared memory for the handover: ``SHM_DIR`` a writable folder (Linux) and not switched off."""
    return os.environ.get(SHM_ENV, "1") != "0" and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def _map(path: str, dtype: str, shape: list[int]) -> np.ndarray | None:
    """The child: the array the parent wrote into ``path``, mapped (no copy), the file unlinked at once (the mapping
    keeps its pages until the array is freed); None where it cannot be read."""
    try:
        with open(path, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    arr = np.frombuffer(mm, dtype=np.dtype(dtype))
    return arr.reshape(shape) if arr.size == math.prod(shape) else None


def _read_exact(f: BinaryIO, n: int) -> bytes | None:
    out = f.read(n)
    return out if out is not None and len(out) == n else None


def _read_into(f: Any, view: memoryview) -> bool:
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            return False
        done += n
    return True


def _read_frame(f: BinaryIO) -> dict[str, Any] | None:
    head = _read_exact(f, _LEN.size)
    if head is None:
        return None
    body = _read_exact(f, _LEN.unpack(head)[0])
    return None if body is None else json.loads(body)


_F_SETPIPE_SZ = 1031  # Linux fcntl.h (Python's fcntl has it from 3.10 on some builds only)


def _widen(fd: int) -> int:
    """The pipe's kernel buffer raised to the system's pipe-max-size (Linux: 1 MiB unless set otherwise; 64 KiB
    by default): a step's tensors then cross in 16 times fewer wake-ups of the two processes (a CPU step's 0.2 GB
    handed over in a median 0.48 s instead of 0.66 s on a 2-core machine). The size it has after, 0 where the
    system does not say (never an error)."""
    try:
        import fcntl

        with open("/proc/sys/fs/pipe-max-size") as f:
            most = int(f.read())
        return fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", _F_SETPIPE_SZ), most)
    except (OSError, ValueError, ImportError):
        return 0


def main() -> int:
    """The child: frames from stdin into a ``CaptureWriter`` (its own thread writes while the pipe is read)."""
    # Ctrl-C stops the training, and a SIGTERM or SIGHUP sent to its whole process group (a launcher stopping its
    # workers) too: this process finishes the file, and ends when the pipe does
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    f = sys.stdin.buffer
    first = _read_frame(f)
    if first is None or first.get("t") != "open":
        return 2
    # background: the pipe is read while earlier steps are written, so a step is out of the training process as
    # fast as the pipe carries it (its handover is what the training process's step() waits for)
    writer = CaptureWriter(first["path"], first["attrs"], background=True, threads=int(first["threads"]),
                           compression=first["compression"])
    os.write(sys.stdout.fileno(), _READY)  # the file is open: the training process may go on
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())  # the parent has closed its end: nothing else goes there
    os.close(null)
    open_steps: dict[int, _Open] = {}
    try:
        while True:
            msg = _read_frame(f)
            if msg is None or msg["t"] == "close":
                break
            kind = msg["t"]
            if kind == "scalars":
                writer.submit_scalars(int(msg["step"]), msg["values"])
                continue
            step = int(msg["step"])
            if kind == "array":
                entry = open_steps.get(step)
                if entry is None or not entry.read_piece(f, msg):
                    return 3  # cut short (or out of order): the steps before it are complete
                continue
            if kind == "shm":
                entry = open_steps.get(step)
                arr = _map(msg["path"], msg["dtype"], msg["shape"])
                if entry is not None and arr is not None:
                    entry.arrived(int(msg["seq"]), arr)
                continue
            if kind == "end":
                entry = open_steps.pop(step, None)
                if entry is not None:
                    entry.submit(writer)
                continue
            data: dict[int, np.ndarray] = {}
            unread: list[int] = []  # in shared memory, but its file could not be read
            for seq, dtype, shape, *shared in msg["arrays"]:
                if shared:  # in shared memory: mapped (a file that cannot be read keeps the tensor's statistics)
                    mapped = _map(shared[0], dtype, shape)
                    if mapped is not None:
                        data[int(seq)] = mapped
                    else:
                        unread.append(int(seq))
                    continue
                arr = np.empty(shape, dtype=np.dtype(dtype))
                if not _read_into(f, arr.reshape(-1).view(np.uint8).data):
                    return 3  # cut short: the step is not written, the ones before it are complete
                data[int(seq)] = arr
            rows = _unpack_rows(msg, data.pop(-1, None))
            later = msg.get("later") or []
            entry = _Open(step, rows, msg["attrs"], data, [*later, *unread])  # unread: written as lost
            if later:
                open_steps[step] = entry
            else:
                entry.submit(writer)
    finally:
        for step in sorted(open_steps):  # the training process ended before their tensors all came
            open_steps[step].submit(writer)
        writer.close()
    return 0  # a write that failed was said by the writer itself, once (its one warning): nothing more to report


class _Open:
    """A step whose records came, waiting for the tensors that were still on their way to the host."""

    def __init__(self, step: int, rows: list[dict[str, Any]], attrs: dict[str, Any], data: dict[int, np.ndarray],
                 later: list[int]):
        self.step, self.rows, self.attrs, self.data = step, rows, attrs, data
        self.later = {int(seq) for seq in later}
        self.partial: dict[int, np.ndarray] = {}

    def read_piece(self, f: BinaryIO, msg: dict[str, Any]) -> bool:
        seq, at, n = int(msg["seq"]), int(msg["at"]), int(msg["n"])
        arr = self.partial.get(seq)
        if arr is None:
            arr = self.partial[seq] = np.empty(msg["shape"], dtype=np.dtype(msg["dtype"]))
        flat = arr.reshape(-1).view(np.uint8)
        if at + n > flat.nbytes or not _read_into(f, flat[at:at + n].data):
            return False
        if at + n >= flat.nbytes:
            self.arrived(seq, self.partial.pop(seq))
        return True

    def arrived(self, seq: int, arr: np.ndarray) -> None:
        self.data[seq] = arr
        self.later.discard(seq)

    def submit(self, writer: CaptureWriter) -> None:
        rows: Rows = self.rows
        attrs = self.attrs
        if self.later:
            lost = set(self.later)
            rows = without_data(rows, lost)
            attrs = {**attrs, "tensors_lost": len(lost)}
            _warn(f"tensordiff: {len(lost)} full tensor(s) of step {self.step} did not reach the writer (the training "
                  f"process ended first): {writer.path} keeps their statistics")
        writer.submit(self.step, rows, self.data, attrs)


if __name__ == "__main__":
    sys.exit(main())
