"""Shared memory between the ranks of one host, for read-once loads.

A reader's read ring lives in a /dev/shm file; the other ranks on its host copy the regions they
want straight out of it, told where by a small announcement over the process group (one for many
ranges), instead of receiving them through sockets: no packing, no socket copies, and each rank
copies its own regions on its own core.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import socket
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

SHM_DIR = "/dev/shm"
HOST_ENV, SHM_DIR_ENV = "CKPT_PLUGINS_HOST", "CKPT_PLUGINS_SHM_DIR"
_NAME = re.compile(r"ckpt_plugins-(\d+)-[0-9a-f]{16}")
ANNOUNCED = 32  # the most ranges one announcement names
PATH_BYTES = 120
ANNOUNCE_BYTES = 16 + 8 * ANNOUNCED + PATH_BYTES  # count, final, offsets, the segment's path


def shm_dir() -> str:
    """This host's shared-memory directory: /dev/shm, or `CKPT_PLUGINS_SHM_DIR` (a tmpfs
    directory of its own per simulated host in tests, or a larger tmpfs mount)."""
    return os.environ.get(SHM_DIR_ENV) or SHM_DIR


def host_key() -> Optional[str]:
    """Ranks with equal keys can share segments: same host, boot, shared-memory mount and user
    (`CKPT_PLUGINS_HOST` is added, so groups of local processes can act as separate hosts).
    None where there is no writable shared-memory directory."""
    try:
        directory = shm_dir()
        if not os.access(directory, os.W_OK):
            return None
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        key = f"{socket.gethostname()}/{boot}/{os.stat(directory).st_dev}/{os.getuid()}"
        simulated = os.environ.get(HOST_ENV)
        return f"{key}/{simulated}" if simulated else key
    except OSError:
        return None


def remove_stale() -> None:
    """Remove the segments of processes on this host that are gone: a reader killed before every
    rank attached could not remove its own."""
    directory = shm_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        m = _NAME.fullmatch(name)
        if m and not alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Segment:
    """A /dev/shm file mapped into this process; `tensor` is its bytes (uint8). Its creator
    unlinks the name once the other ranks have attached (the memory lives while mapped)."""

    def __init__(self, path: str, tensor: torch.Tensor, owner: bool):
        self.path, self.tensor, self.owner = path, tensor, owner

    @classmethod
    def create(cls, nbytes: int) -> "Segment":
        remove_stale()
        path = os.path.join(shm_dir(), f"ckpt_plugins-{os.getpid()}-{secrets.token_hex(8)}")
        if len(path.encode()) > PATH_BYTES:  # other ranks could not be told it
            raise OSError(errno.ENAMETOOLONG, f"a shared-memory path longer than {PATH_BYTES} bytes", path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # reserve the memory now: a full /dev/shm raises here, not SIGBUS on a later write
            os.posix_fallocate(fd, 0, nbytes)
            return cls(path, torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8), owner=True)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, path: str) -> "Segment":
        """Another rank's segment, by the path it sent (checked to be one of ours in /dev/shm)."""
        if os.path.dirname(path) != shm_dir() or not _NAME.fullmatch(os.path.basename(path)):
            raise ValueError(f"not a ckpt_plugins shared-memory segment: {path!r}")
        fd = os.open(path, os.O_RDWR)
        try:
            return cls(path, torch.frombuffer(mmap.mmap(fd, os.fstat(fd).st_size), dtype=torch.uint8), owner=False)
        finally:
            os.close(fd)

    def unlink(self) -> None:
        if self.owner:
            self.owner = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def announcement(self, offsets: Sequence[int], final: bool) -> torch.Tensor:
        """Tells another rank that ranges start at `offsets` (at most ANNOUNCED) of this segment;
        `final`: the last of a pass over the ring, acknowledged once its ranges are copied out."""
        words = [len(offsets), int(final)] + list(offsets) + [0] * (ANNOUNCED - len(offsets))
        data = b"".join(w.to_bytes(8, "little") for w in words) + self.path.encode().ljust(PATH_BYTES, b"\0")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass
class Announcement:
    """What a received announcement says: where its ranges start in the segment at `path`, and
    whether it ends a pass (then acknowledged)."""
    path: str
    offsets: List[int]
    final: bool

    @classmethod
    def parse(cls, message: torch.Tensor) -> "Announcement":
        data = bytes(message.numpy())
        words = [int.from_bytes(data[8 * i:8 * i + 8], "little") for i in range(2 + ANNOUNCED)]
        count = words[0]
        if not 0 < count <= ANNOUNCED:
            raise ValueError(f"a shared-memory announcement of {count} ranges (1 to {ANNOUNCED})")
        return cls(data[16 + 8 * ANNOUNCED:].rstrip(b"\0").decode(), words[2:2 + count], bool(words[1]))


class Attached:
    """The segments this rank has attached, by path (each once per load)."""

    def __init__(self):
        self.segments: Dict[str, Segment] = {}

    def memory(self, path: str) -> torch.Tensor:
        """The bytes of the segment at `path` (an announcement's)."""
        if path not in self.segments:
            self.segments[path] = Segment.attach(path)
        return self.segments[path].tensor
