"""`torch.save` archives read in place: the pickled structure, with every tensor a `TensorLocation`
(where its raw bytes lie in the file) instead of data, and every class it names beyond plain
containers an inert `StandIn`. The archive is an uncompressed zip: its `data.pkl` holds the
structure, its `data/<key>` records the storages' bytes. Nothing from the file is executed and no
tensor byte is read, so a foreign format's tensors become stored boxes read once by the load plan.
"""
from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from ..errors import CheckpointError, CorruptCheckpointError
from ..storage import Storage
from .pickles import _stand_in

_STORAGE_DTYPES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
                   "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                   "BoolStorage": torch.bool, "Float8_e4m3fnStorage": torch.float8_e4m3fn,
                   "Float8_e5m2Storage": torch.float8_e5m2}


@dataclass(frozen=True)
class TensorLocation:
    """A tensor of a `torch.save` archive: `file`, the byte `offset` of its first element there, its
    dtype and shape; `contiguous`: its elements lie row-major from there on."""
    file: str
    offset: int
    dtype: torch.dtype
    shape: Tuple[int, ...]
    contiguous: bool

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of a stored file, as a seekable file (for zipfile)."""

    def __init__(self, storage: Storage, name: str, offset: int, length: int):
        self.storage, self.name, self.offset, self.length, self.pos = storage, name, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, [pos, self.pos + pos, self.length + pos][whence])
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        if n:
            self.storage.read_into(self.name, self.offset + self.pos, memoryview(buffer)[:n])
            self.pos += n
        return n


def _contiguous(size: Tuple[int, ...], stride: Tuple[int, ...]) -> bool:
    expect = 1
    for s, st in zip(reversed(size), reversed(stride)):
        if s != 1 and st != expect:
            return False
        expect *= s
    return True


class _Located(pickle.Unpickler):
    """A `data.pkl` read for where its tensors are: storages by record key, tensors as locations,
    Parameters as their data, other classes as stand-ins."""

    def __init__(self, data: bytes, where):
        super().__init__(io.BytesIO(data))
        self.where = where  # record key -> (file, byte offset of the record's data)

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return lambda data, *rest: data
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):  # a Parameter, a tensor subclass
            return lambda func, new_type, args, state: func(*args)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "builtins" and name in ("set", "frozenset", "slice", "complex"):
            return {"set": set, "frozenset": frozenset, "slice": slice, "complex": complex}[name]
        return _stand_in(f"{module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)):
            raise pickle.UnpicklingError(f"unexpected storage reference {pid!r}")
        return pid[1], str(pid[2])

    def _tensor(self, storage, offset, size, stride, *rest) -> TensorLocation:
        dtype, key = storage
        file, start = self.where(key)
        return TensorLocation(file, start + int(offset) * dtype.itemsize, dtype, tuple(int(s) for s in size),
                              _contiguous(tuple(size), tuple(stride)))


def read_archive(storage: Storage, name: str, offset: int = 0, length: Optional[int] = None) -> Any:
    """The structure of the `torch.save` archive at [offset, offset + length) of `name` (the whole
    file by default), tensors as `TensorLocation`s (see the module docstring)."""
    length = storage.size(name) - offset if length is None else length
    what = f"{storage}/{name}" + (f" (bytes {offset}..{offset + length})" if offset else "")
    try:
        with zipfile.ZipFile(_Window(storage, name, offset, length)) as archive:
            infos = {i.filename: i for i in archive.infolist()}
            pkl = next((n for n in infos if n.endswith("data.pkl")), None)
            if pkl is None:
                raise CorruptCheckpointError(f"{what} is not a torch.save archive (no data.pkl)")
            root = pkl[:-len("data.pkl")]
            starts: Dict[str, Tuple[str, int]] = {}

            def where(key: str) -> Tuple[str, int]:
                if key not in starts:
                    record = infos.get(f"{root}data/{key}")
                    if record is None or record.compress_type != zipfile.ZIP_STORED:
                        raise CorruptCheckpointError(f"{what}: storage {key} is missing or compressed")
                    head = bytearray(30)
                    storage.read_into(name, offset + record.header_offset, head)
                    if head[:4] != b"PK\x03\x04":
                        raise CorruptCheckpointError(f"{what}: damaged archive (no local header for storage {key})")
                    name_len, extra_len = struct.unpack("<HH", head[26:30])
                    data = record.header_offset + 30 + name_len + extra_len
                    if data + record.file_size > length:
                        raise CorruptCheckpointError(f"{what}: storage {key} runs past the archive")
                    starts[key] = (name, offset + data, record.file_size)
                file, start, _ = starts[key]
                return file, start

            value = _Located(archive.read(pkl), where).load()
    except CheckpointError:
        raise
    except Exception as exc:  # whatever a damaged archive makes zipfile or the unpickler raise
        raise CorruptCheckpointError(f"{what} is not a readable torch.save archive: {type(exc).__name__}: {exc}") from None
    _check_extents(value, starts, what)
    return value


def _check_extents(value: Any, starts: Dict[str, Tuple[str, int, int]], what: str) -> None:
    """Every located tensor lies inside its storage's record."""
    records = sorted((start, start + size) for _, start, size in starts.values())
    for loc in _locations(value):
        inside = [end for start, end in records if start <= loc.offset]
        if not inside or loc.offset + loc.nbytes > inside[-1]:
            raise CorruptCheckpointError(f"{what}: a tensor of shape {list(loc.shape)} runs past its storage")


def _locations(value: Any):
    if isinstance(value, TensorLocation):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _locations(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _locations(v)


def read_located(storage: Storage, loc: TensorLocation) -> torch.Tensor:
    """The tensor a location names, read (for small ones: steps, a scheduler's state)."""
    if not loc.contiguous:
        raise CorruptCheckpointError(f"{storage}/{loc.file}: a non-contiguous tensor cannot be read in place")
    data = bytearray(loc.nbytes)
    storage.read_into(loc.file, loc.offset, data)
    return torch.frombuffer(data, dtype=torch.uint8).view(loc.dtype).reshape(loc.shape) if data else \
        torch.empty(loc.shape, dtype=loc.dtype)
