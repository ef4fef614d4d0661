"""Shared memory between the ranks of one host, for read-once loads.

A reader's read ring lives in a /dev/shm file; the other ranks on its host copy the regions they
want straight out of it, told where by a small header over the process group, instead of
receiving them through sockets: no packing, no socket copies, and each rank copies its own
regions on its own core.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import socket
from typing import Dict, Optional, Tuple

import torch

SHM_DIR = "/dev/shm"
HOST_ENV, SHM_DIR_ENV = "CKPT_PLUGINS_HOST", "CKPT_PLUGINS_SHM_DIR"
_NAME = re.compile(r"ckpt_plugins-(\d+)-[0-9a-f]{16}")
HEADER_BYTES = 128  # where a range lies: its offset (8 bytes) and the segment's path


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

    def header(self, offset: int) -> torch.Tensor:
        """The header telling another rank that a range starts at `offset` of this segment."""
        data = offset.to_bytes(8, "little") + self.path.encode()
        return torch.frombuffer(bytearray(data.ljust(HEADER_BYTES, b"\0")), dtype=torch.uint8)


class Attached:
    """The segments this rank has attached, by path (each once per load)."""

    def __init__(self):
        self.segments: Dict[str, Segment] = {}

    def locate(self, header: torch.Tensor) -> Tuple[torch.Tensor, int]:
        """The segment's bytes and the offset a received header names."""
        data = bytes(header.numpy())
        path = data[8:].rstrip(b"\0").decode()
        if path not in self.segments:
            self.segments[path] = Segment.attach(path)
        return self.segments[path].tensor, int.from_bytes(data[:8], "little")
