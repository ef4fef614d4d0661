"""A memory step as one rank's load sees it: the data files on this host (read in place), the
metadata and object files every rank was given, and which ranks can read each data file, so the
load reads a file where it lies and passes the bytes on (`Storage.readers`). Read only."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import CorruptCheckpointError
from ..storage import LocalStorage, Storage, Writer


class TierStorage(Storage):
    def __init__(self, local: LocalStorage, sizes: Dict[str, int], holders: Dict[str, Tuple[int, ...]],
                 small: Dict[str, bytes], label: str):
        self.local, self.sizes, self.holders, self.small, self.label = local, sizes, holders, small, label

    def __str__(self) -> str:
        return self.label

    @property
    def identity(self) -> str:
        return self.local.identity

    def read_parallelism(self, default: int) -> int:
        # copies from shared memory, CPU-bound: more threads than cores only contend
        # (bench/memory_tier.py's recovery)
        return max(1, min(default, len(os.sched_getaffinity(0))))

    def readers(self, name: str) -> Optional[Sequence[int]]:
        return self.holders.get(name, ())

    @property
    def restricted(self) -> bool:
        return True

    def read_into(self, name: str, offset: int, buffer) -> None:
        if name in self.small:
            view = memoryview(buffer).cast("B")
            data = self.small[name][offset:offset + len(view)]
            if len(data) != len(view):
                raise CorruptCheckpointError(f"{name} of {self} is truncated")
            view[:] = data
        elif self.local.exists(name):
            self.local.read_into(name, offset, buffer)
        else:
            raise CorruptCheckpointError(f"{name} of {self} is not in this host's memory")

    def read_bytes(self, name: str) -> bytes:
        return self.small[name] if name in self.small else self.local.read_bytes(name)

    def exists(self, name: str) -> bool:
        return name in self.small or name in self.sizes

    def size(self, name: str) -> int:
        if name in self.small:
            return len(self.small[name])
        if name not in self.sizes:
            raise FileNotFoundError(name)
        return self.sizes[name]

    def listdir(self, name: str = "") -> List[str]:
        prefix = f"{name.rstrip('/')}/" if name else ""
        return sorted({n[len(prefix):].split("/")[0] for n in (*self.sizes, *self.small) if n.startswith(prefix)})

    def _read_only(self, *_):
        raise PermissionError(f"{self} is a memory step being loaded: it is read only")

    def open_writer(self, name: str) -> Writer:
        self._read_only()

    def put_atomic(self, name: str, data: bytes) -> None:
        self._read_only()

    def remove(self, name: str) -> None:
        self._read_only()

    def prepare(self) -> None:
        self._read_only()
