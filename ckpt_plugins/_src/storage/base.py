"""What a storage backend is: where checkpoint bytes live.

The interface is small on purpose so an object store fits: whole-file sequential writers,
ranged reads, and an atomic small-object put for the metadata (the commit). Nothing relies on
rename across files, listing order, or appends.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import List, Optional, Sequence


class Writer(ABC):
    direct_bytes = 0  # bytes written bypassing the page cache (telemetry)
    retries = 0  # transient failures retried (telemetry)

    @abstractmethod
    def write(self, data) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Make everything written durable, then release the file."""


class durable:
    """`with durable(writer):` the block writes, then `writer` is closed (made durable). After a
    failed block, the writer is closed all the same, and a close that fails too (the fsync of a
    full disk) is not reported over the block's failure."""

    def __init__(self, writer: Writer):
        self.writer = writer

    def __enter__(self) -> Writer:
        return self.writer

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.writer.close()
            return
        with contextlib.suppress(Exception):
            self.writer.close()


class Storage(ABC):
    """A checkpoint's namespace: names are relative '/'-separated paths inside it."""

    @abstractmethod
    def open_writer(self, name: str) -> Writer: ...

    @abstractmethod
    def read_into(self, name: str, offset: int, buffer) -> None:
        """Fill `buffer` (writable bytes-like) from `name` at `offset`; short data is an error."""

    @abstractmethod
    def read_bytes(self, name: str) -> bytes: ...

    @property
    def direct_alignment(self) -> Optional[int]:
        """The alignment (of file offset, memory address and length) at which `read_into` bypasses
        the page cache for a range of `hostmem.DIRECT_MIN` bytes or more; None when it never does.
        Loads then stage such reads in aligned memory."""
        return None

    @property
    def identity(self) -> str:
        """What names this checkpoint alike on every rank (the ranks of one save or load must agree
        on it): its path, unless each host keeps its own copy under its own path."""
        return str(self)

    def read_parallelism(self, default: int) -> int:
        """How many reads to keep in flight: `default` (more than the cores, since reads mostly wait
        on a device). Storage in memory overrides it: its reads are copies, CPU-bound."""
        return default

    def readers(self, name: str) -> Optional[Sequence[int]]:
        """The ranks of the loading job that can read file `name`; None when every rank can (a
        shared filesystem or object store). Loads read a file only on its readers and pass the
        bytes on (the memory tier's files live on some hosts only)."""
        return None

    @property
    def restricted(self) -> bool:
        """Whether `readers` may name some ranks only: a load asks it about each file it reads
        only then (at scale, hundreds of thousands of files)."""
        return False

    @abstractmethod
    def put_atomic(self, name: str, data: bytes) -> None:
        """Write a small file so that readers see either nothing or all of it."""

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Create `name` holding `data` unless it exists; False when it does. Object stores have no
        portable create-if-absent: this default checks, then writes (best effort)."""
        if self.exists(name):
            return False
        self.put_atomic(name, data)
        return True

    @abstractmethod
    def exists(self, name: str) -> bool: ...

    @abstractmethod
    def size(self, name: str) -> int: ...

    @abstractmethod
    def listdir(self, name: str = "") -> List[str]: ...

    @abstractmethod
    def remove(self, name: str) -> None:
        """Remove a file or a whole sub-tree; absent names are fine."""

    @abstractmethod
    def prepare(self) -> None:
        """Create the checkpoint's namespace if needed (called by the coordinator before writes)."""
