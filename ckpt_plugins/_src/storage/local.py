"""A POSIX directory as Storage: O_DIRECT writes from aligned buffers, O_DIRECT reads where the
range and the memory are aligned and the range is big, an atomic rename for the metadata."""
from __future__ import annotations

import errno
import os
import shutil
from typing import Dict, List, Optional

from ..errors import CorruptCheckpointError, UnsafePathError
from ..hostmem import DIRECT_MIN, PAGE as ALIGN
from .base import Storage, Writer
from .stream import address


class _FileWriter(Writer):
    """Sequential writer; page-aligned pieces of page-aligned buffers go through O_DIRECT.

    O_DIRECT writes from the aligned staging buffers run several times faster than buffered writes
    plus fsync (`bench/save_load.py` prints the write limit both ways). Filesystems without O_DIRECT (tmpfs) and unaligned tails use
    the buffered descriptor; fsync at close covers both.
    """

    def __init__(self, path: str, direct: bool):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._direct_fd = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:
                pass
        self._pos = 0
        self.path = path

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        if self._direct_fd is not None and self._pos % ALIGN == 0 and address(view) % ALIGN == 0:
            aligned = len(view) // ALIGN * ALIGN
            try:
                self._pwrite(self._direct_fd, view[:aligned])
                self.direct_bytes += aligned
                view = view[aligned:]
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(self._direct_fd)  # this filesystem refuses direct I/O after all
                self._direct_fd = None
        self._pwrite(self._fd, view)

    def _pwrite(self, fd: int, view: memoryview) -> None:
        while view:
            written = os.pwrite(fd, view, self._pos)
            view = view[written:]
            self._pos += written

    def close(self) -> None:
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            if self._direct_fd is not None:
                os.close(self._direct_fd)


class LocalStorage(Storage):
    """A POSIX directory. Every name is resolved and checked to stay inside the root."""

    def __init__(self, root: str, direct_io: bool = True, identity: Optional[str] = None):
        self.root = os.path.abspath(root)
        self.direct_io = direct_io
        self._identity = identity  # a host's own copy of a checkpoint the ranks name alike
        self._read_paths: Dict[str, str] = {}  # by name: the checked path of a file read from

    def __str__(self) -> str:
        return self.root

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"

    @property
    def identity(self) -> str:
        return self._identity or self.root

    def path(self, name: str) -> str:
        full = os.path.realpath(os.path.join(self.root, name))
        root = os.path.realpath(self.root)
        if full != root and not full.startswith(root + os.sep):
            raise UnsafePathError(f"{name!r} resolves to {full}, outside checkpoint {root}")
        return full

    def prepare(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def open_writer(self, name: str) -> Writer:
        path = self.path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return _FileWriter(path, self.direct_io)

    @property
    def direct_alignment(self) -> Optional[int]:
        return ALIGN if self.direct_io and hasattr(os, "O_DIRECT") else None

    def read_into(self, name: str, offset: int, buffer) -> None:
        """Bytes at `offset` into `buffer`: the page-aligned body of an aligned range of at least
        DIRECT_MIN bytes with O_DIRECT (faster cold reads, at a fraction of the CPU time, than
        through the page cache); the rest, smaller ranges (which the page cache keeps: with
        O_DIRECT each costs a trip to the device) and filesystems without direct I/O, buffered."""
        view = memoryview(buffer).cast("B")
        path = self._read_paths.get(name)
        if path is None:  # resolved once: a load reads many ranges of a file, and resolving walks its directories
            path = self._read_paths[name] = self.path(name)
        done = 0
        if self.direct_alignment and offset % ALIGN == 0 and address(view) % ALIGN == 0 and len(view) >= DIRECT_MIN:
            try:
                done = self._direct_read(path, offset, view[:len(view) // ALIGN * ALIGN])
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct_io = False  # this filesystem refuses direct I/O
        if done and done == len(view):  # all of it read directly
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            while done < len(view):
                got = os.preadv(fd, [view[done:]], offset + done)
                if got == 0:
                    raise CorruptCheckpointError(
                        f"{name} is truncated: wanted bytes {offset}..{offset + len(view)}, "
                        f"file ends at {offset + done}")
                done += got
        finally:
            os.close(fd)

    @staticmethod
    def _direct_read(path: str, offset: int, view: memoryview) -> int:
        """Aligned reads until done or the end of the file (left to the buffered read to report)."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            done = 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], offset + done)
                done += got
                if got % ALIGN or not got:
                    break
            return done
        finally:
            os.close(fd)

    def read_bytes(self, name: str) -> bytes:
        with open(self.path(name), "rb") as f:
            return f.read()

    def put_atomic(self, name: str, data: bytes) -> None:
        path = self.path(name)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        path = self.path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:  # no fsync: O_EXCL decides who holds it, and a lock need not outlive a crash
            os.write(fd, data)
        finally:
            os.close(fd)
        return True

    def exists(self, name: str) -> bool:
        return os.path.exists(self.path(name))

    def size(self, name: str) -> int:
        return os.stat(self.path(name)).st_size

    def listdir(self, name: str = "") -> List[str]:
        try:
            return sorted(os.listdir(self.path(name)))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []

    def remove(self, name: str) -> None:
        path = self.path(name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=False)
        else:
            try:
                os.unlink(path)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
