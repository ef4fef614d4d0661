"""One host's part of the memory tier: a directory in its shared memory (tmpfs) holding a
checkpoint per memory step, in the on-disk format: its ranks' own files, the replicas of another
host's ranks, and the step's metadata once committed."""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch

from .. import shm
from ..format import DATA_DIR, METADATA_FILE
from ..metadata_codec import decode_metadata
from ..storage import LocalStorage
from .layout import StepFiles

log = logging.getLogger("ckpt_plugins")
_STEP = re.compile(r"step_(\d+)")
PART = ".part"  # a replica still arriving
PIECE = 32 << 20  # files move between hosts and to storage in pieces of this size


def pieces(files: Dict[str, int]) -> Iterator[Tuple[str, int, int]]:
    """(file, offset, length) of every piece of `files` (name -> size), in one order for all."""
    for name, size in sorted(files.items()):
        for offset in range(0, size, PIECE):
            yield name, offset, min(PIECE, size - offset)


class HostDir:
    """`<shared memory>/ckpt_plugins-tier-<run>/step_<N>/`, the run named by its storage root so a
    restarted job finds what the previous one left."""

    def __init__(self, root: str, directory: Optional[str] = None):
        name = root if "://" in root else os.path.abspath(root)  # a restart may name it otherwise
        run = hashlib.sha256(name.encode()).hexdigest()[:16]
        self.run = name
        self.path = directory or os.path.join(shm.shm_dir(), f"ckpt_plugins-tier-{run}")

    def __str__(self) -> str:
        return self.path

    def step_path(self, step: int) -> str:
        return os.path.join(self.path, f"step_{int(step)}")

    def storage(self, step: int) -> LocalStorage:
        # tmpfs has no direct I/O; each host's copy of the step is one checkpoint to the ranks
        return LocalStorage(self.step_path(step), direct_io=False, identity=f"memory step {int(step)} of {self.run}")

    def steps(self) -> Dict[int, str]:
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return {}
        return {int(m.group(1)): os.path.join(self.path, n) for n in names for m in [_STEP.fullmatch(n)] if m}

    def inventory(self) -> Dict[int, StepFiles]:
        """What this host holds of each step: its files and, where committed, what its metadata names."""
        out = {}
        for step, path in self.steps().items():
            files = StepFiles()
            data = os.path.join(path, DATA_DIR)
            for name in os.listdir(data) if os.path.isdir(data) else []:
                if not name.endswith(PART):
                    files.present[f"{DATA_DIR}/{name}"] = os.path.getsize(os.path.join(data, name))
            meta_path = os.path.join(path, METADATA_FILE)
            if os.path.exists(meta_path):
                try:
                    with open(meta_path, "rb") as f:
                        raw = f.read()
                    metadata = decode_metadata(raw)
                    files.present[METADATA_FILE] = len(raw)
                    files.required = dict(metadata.files)
                    files.objects = tuple(sorted({o.file for entries in metadata.objects.values() for o in entries}))
                except Exception as exc:  # a corrupt copy counts as none: another host may have one
                    log.warning("memory tier: %s is unreadable (%s: %s); ignoring it", meta_path, type(exc).__name__, exc)
            out[step] = files
        return out

    def drop(self, keep: Iterable[int]) -> None:
        """Remove every step but `keep`."""
        keep = set(keep)
        for step, path in self.steps().items():
            if step not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def write_metadata(self, step: int, data: bytes) -> None:
        self.storage(step).put_atomic(METADATA_FILE, data)

    def land(self, step: int, name: str, nbytes: int) -> "Landing":
        return Landing(os.path.join(self.step_path(step), name), nbytes)

    def read_piece(self, step: int, name: str, offset: int, buffer: torch.Tensor) -> None:
        """Fill `buffer` from `name` at `offset` (short data is an error)."""
        self.storage(step).read_into(name, offset, buffer.numpy())


class Landing:
    """A file arriving from another host, written piece by piece under a `.part` name, reserved
    in full first (a full tmpfs fails here, not midway) and renamed when whole. It owns the
    partial file: `close()` without `keep()` removes it."""

    def __init__(self, path: str, nbytes: int):
        self.path, self.nbytes = path, nbytes
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._part = path + PART
        self._fd = os.open(self._part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if nbytes:
                os.posix_fallocate(self._fd, 0, nbytes)
        except BaseException:
            self.close()
            raise

    def write(self, offset: int, data: torch.Tensor) -> None:
        view = memoryview(data.numpy())
        while view:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def keep(self) -> None:
        os.close(self._fd)
        self._fd = None
        os.replace(self._part, self.path)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            try:
                os.unlink(self._part)
            except FileNotFoundError:
                pass
