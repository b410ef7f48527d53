"""One tensor from a ``torch.save`` file, read without unpickling and without torch.

A ``torch.save(tensor, f)`` file is a zip archive: ``<name>/data.pkl`` (a pickle that rebuilds the tensor from a
storage) and ``<name>/data/<key>`` (the storage's raw bytes). ``read_tensor`` never runs the pickle: it walks its
opcodes (``pickletools.genops``) on a small stack of plain values and accepts exactly the program ``torch.save``
writes for one dense tensor:

    torch._utils._rebuild_tensor_v2(persistent_id(('storage', torch.<Type>Storage, key, location, numel)),
                                    offset, size, stride, requires_grad, collections.OrderedDict())

Any other name (a class, a function, ``os.system``), any other opcode, or a tensor that does not fit its storage is
refused with one line (``CaptureFileError``). The bytes are then laid out with numpy (``as_strided``, copied).
Used for msprobe's ``.pt`` dumps (``store/msprobe.py``), so that reading them needs neither torch nor trust.
"""

from __future__ import annotations

import pickletools
import sys
import zipfile
from typing import Any

import numpy as np

from ..errors import CaptureFileError

#: torch's legacy storage class names (what ``torch.save`` writes) -> (logical dtype, numpy dtype of the bytes)
STORAGES: dict[str, tuple[str, np.dtype]] = {
    "FloatStorage": ("float32", np.dtype("<f4")),
    "DoubleStorage": ("float64", np.dtype("<f8")),
    "HalfStorage": ("float16", np.dtype("<f2")),
    "BFloat16Storage": ("bfloat16", np.dtype("<u2")),
    "LongStorage": ("int64", np.dtype("<i8")),
    "IntStorage": ("int32", np.dtype("<i4")),
    "ShortStorage": ("int16", np.dtype("<i2")),
    "CharStorage": ("int8", np.dtype("i1")),
    "ByteStorage": ("uint8", np.dtype("u1")),
    "BoolStorage": ("bool", np.dtype("?")),
}
_REBUILD = ("torch._utils", "_rebuild_tensor_v2")
_ORDERED_DICT = ("collections", "OrderedDict")
_PLAIN = {"PROTO", "FRAME", "BINPUT", "LONG_BINPUT", "MEMOIZE", "BINGET", "LONG_BINGET", "MARK", "TUPLE", "TUPLE1",
          "TUPLE2", "TUPLE3", "EMPTY_TUPLE", "BINUNICODE", "SHORT_BINUNICODE", "BININT", "BININT1", "BININT2", "LONG1",
          "NEWFALSE", "NEWTRUE", "NONE", "EMPTY_DICT", "GLOBAL", "STACK_GLOBAL", "BINPERSID", "REDUCE", "STOP",
          "SETITEM", "SETITEMS"}


class _Global:
    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


class _Storage:
    def __init__(self, type_name: str, key: str, numel: int):
        self.type_name, self.key, self.numel = type_name, key, numel


class _Tensor:
    def __init__(self, storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


class _Mark:
    pass


def _refuse(path: str, problem: str, what: str = "one plain tensor", fix: str = "re-create the dump with msprobe"
            ) -> CaptureFileError:
    return CaptureFileError(f"{path}: refused: {problem}; tensordiff reads a .pt file only when it holds {what} as "
                            f"torch.save writes it (nothing in it is run); {fix}")


def _program(path: str, data: bytes) -> Any:
    """The tensor (or the dict of dicts of tensors) the pickle ``data`` describes, found by walking its opcodes
    (nothing is called)."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    try:
        ops = list(pickletools.genops(data))
    except Exception as err:  # a damaged pickle: genops raises ValueError and friends
        raise _refuse(path, f"its data.pkl is not a readable pickle ({type(err).__name__}: {err})") from None

    def pop_mark() -> list[Any]:
        items: list[Any] = []
        while stack and not isinstance(stack[-1], _Mark):
            items.append(stack.pop())
        if not stack:
            raise _refuse(path, "its data.pkl has a tuple without a mark")
        stack.pop()
        return items[::-1]

    for op, arg, _pos in ops:
        name = op.name
        if name not in _PLAIN:
            raise _refuse(path, f"its data.pkl uses the pickle opcode {name}, which a saved tensor does not need")
        if name in ("PROTO", "FRAME"):
            continue
        if name in ("BINPUT", "LONG_BINPUT"):
            memo[int(arg or 0)] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET"):
            stack.append(memo[int(arg or 0)])
        elif name == "MARK":
            stack.append(_Mark())
        elif name == "TUPLE":
            stack.append(tuple(pop_mark()))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = stack[-n:]
            del stack[-n:]
            stack.append(tuple(items))
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("BINUNICODE", "SHORT_BINUNICODE", "BININT", "BININT1", "BININT2", "LONG1"):
            stack.append(arg)
        elif name in ("NEWFALSE", "NEWTRUE", "NONE"):
            stack.append({"NEWFALSE": False, "NEWTRUE": True, "NONE": None}[name])
        elif name == "EMPTY_DICT":
            stack.append({})
        elif name in ("SETITEM", "SETITEMS"):
            items = [stack.pop(), stack.pop()][::-1] if name == "SETITEM" else pop_mark()
            if not stack or not isinstance(stack[-1], dict) or len(items) % 2:
                raise _refuse(path, "its data.pkl sets items on something that is not a dict")
            for k, v in zip(items[::2], items[1::2]):
                if not isinstance(k, str) or not isinstance(v, (dict, _Tensor)):
                    raise _refuse(path, "its dict holds something other than tensors under names")
                stack[-1][k] = v
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            if name == "GLOBAL":
                module, _, attr = str(arg).partition(" ")
            else:
                attr, module = stack.pop(), stack.pop()
            if (module, attr) not in (_REBUILD, _ORDERED_DICT) and not (module == "torch" and attr in STORAGES):
                raise _refuse(path, f"it names {module}.{attr}, which a saved tensor does not need")
            stack.append(_Global(str(module), str(attr)))
        elif name == "BINPERSID":
            pid = stack.pop()
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Global)
                    and isinstance(pid[2], str) and isinstance(pid[4], int)):
                raise _refuse(path, "its data.pkl refers to something other than a tensor storage")
            stack.append(_Storage(pid[1].name, pid[2], pid[4]))
        elif name == "REDUCE":
            args, func = stack.pop(), stack.pop()
            if not isinstance(func, _Global) or not isinstance(args, tuple):
                raise _refuse(path, "its data.pkl calls something that is not a name")
            if (func.module, func.name) == _ORDERED_DICT and args == ():
                stack.append({})
            elif (func.module, func.name) == _REBUILD and len(args) >= 4 and isinstance(args[0], _Storage):
                storage, offset, size, stride = args[:4]
                if not (isinstance(offset, int) and _ints(size) and _ints(stride) and len(size) == len(stride)):
                    raise _refuse(path, "its tensor's offset, size or stride are not whole numbers")
                stack.append(_Tensor(storage, offset, size, stride))
            else:
                raise _refuse(path, f"its data.pkl calls {func.module}.{func.name} with arguments a tensor does not have")
        elif name == "STOP":
            break
    if len(stack) != 1 or not isinstance(stack[0], (_Tensor, dict)):
        raise _refuse(path, "it holds something other than one tensor")
    return stack[0]


def _ints(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def read_tensor(path: str) -> tuple[np.ndarray, str]:
    """The tensor of a ``torch.save`` file as ``(array, logical dtype)``: BF16 comes back as its raw uint16 bits."""
    archive = TorchArchive(path)
    if archive.single is None:
        raise _refuse(path, "it holds something other than one tensor")
    return archive.array(())


class TorchArchive:
    """A ``torch.save`` file holding one tensor, or dicts (nested) of tensors under names: ``keys`` (tuples of the
    names down to each tensor, ``()`` for a lone tensor), ``shape(key)``, ``dtype(key)`` and ``array(key)``, read when
    asked (the storage last read is kept: tensors that are views of one buffer share it). Nothing is unpickled."""

    def __init__(self, path: str, what: str = "one plain tensor", fix: str = "re-create the dump with msprobe"):
        self.path = path
        self._refuse = lambda problem: _refuse(path, problem, what, fix)
        try:
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
                pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
                if len(pkl) != 1:
                    raise self._refuse("it is a zip archive without one data.pkl")
                self._root = pkl[0][: -len("data.pkl")]
                self._names = set(names)
                self._order = zf.read(self._root + "byteorder").decode("ascii", "replace").strip() \
                    if self._root + "byteorder" in names else "little"
                top = _program(path, zf.read(pkl[0]))
        except zipfile.BadZipFile:
            raise CaptureFileError(f"{path}: not a torch.save zip archive (truncated, or saved with "
                                   "_use_new_zipfile_serialization=False); re-create the file") from None
        except OSError as err:
            raise CaptureFileError(f"{path}: cannot be read ({err.strerror or err}); check the file") from None
        if self._order not in ("little", "big"):
            raise self._refuse(f"its byteorder is {self._order!r}")
        self.tensors: dict[tuple[str, ...], _Tensor] = {}
        self._walk(top, ())
        self.single = top if isinstance(top, _Tensor) else None
        self._cache: tuple[str, bytes] | None = None

    def _walk(self, node: Any, at: tuple[str, ...]) -> None:
        if isinstance(node, _Tensor):
            self.tensors[at] = node
        else:
            for k, v in node.items():
                self._walk(v, (*at, k))

    @property
    def keys(self) -> list[tuple[str, ...]]:
        return list(self.tensors)

    def shape(self, key: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: tuple[str, ...]) -> str:
        return STORAGES[self.tensors[key].storage.type_name][0]

    def array(self, key: tuple[str, ...]) -> tuple[np.ndarray, str]:
        """One tensor as ``(array, logical dtype)`` (BF16 as its raw uint16 bits)."""
        spec = self.tensors[key]
        path = self.path
        name = f"{self._root}data/{spec.storage.key}"
        if name not in self._names:
            raise self._refuse(f"its storage {spec.storage.key!r} is missing from the archive")
        cache = self._cache  # one read of the shared slot: the diff reads tensors from several threads at once
        if cache is None or cache[0] != name:
            try:
                with zipfile.ZipFile(path) as zf:
                    cache = (name, zf.read(name))
            except (zipfile.BadZipFile, OSError) as err:
                raise CaptureFileError(f"{path}: cannot be read ({err}); check the file") from None
            self._cache = cache
        raw = cache[1]
        logical, dtype = STORAGES[spec.storage.type_name]
        if self._order != sys.byteorder and dtype.itemsize > 1:
            dtype = dtype.newbyteorder(">" if self._order == "big" else "<")
        count = len(raw) // dtype.itemsize
        if count < spec.storage.numel:
            raise CaptureFileError(f"{path}: its storage holds {count} elements, the file says {spec.storage.numel}; "
                                   "the file is truncated, re-create it")
        flat = np.frombuffer(raw, dtype=dtype, count=spec.storage.numel)
        last = spec.offset + sum((s - 1) * st for s, st in zip(spec.size, spec.stride)) if all(spec.size) \
            else spec.offset - 1
        if spec.offset < 0 or (last >= spec.storage.numel and all(spec.size)):
            raise self._refuse(f"its tensor {list(spec.size)} (offset {spec.offset}, stride {list(spec.stride)}) "
                               f"reaches past its storage of {spec.storage.numel} elements")
        if not all(spec.size):
            out = np.empty(spec.size, dtype=dtype)
        else:
            out = np.lib.stride_tricks.as_strided(flat[spec.offset:], shape=spec.size,
                                                  strides=tuple(st * dtype.itemsize for st in spec.stride)).copy()
        return out.astype(dtype.newbyteorder("=")) if not dtype.isnative else out, logical
