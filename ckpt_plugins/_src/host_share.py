"""A checkpoint's metadata read once per host, not once per rank.

At scale every rank of a load needs the whole metadata (tens of MB at 16,384 ranks): read by each
rank, that is a full copy per rank from shared storage. Here the first rank of a host to ask
reads it (and checks the data files' sizes) and leaves the bytes in the host's shared-memory
directory; the host's other ranks, waiting on a lock, take them from there and decode them
themselves. Nothing is coordinated over the process group: the lock and the file live in the
host's shared-memory directory, so simulated hosts (their own directories) each read once too.

The publisher removes its copy once every rank of the load has read it (the load's first
agreement, `release`). A copy whose publisher is gone is never used: a rank finding one reads
the storage itself, and removes it.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
from typing import Optional

from . import shm
from .committed import read_committed
from .format import Metadata
from .metadata_codec import decode_metadata
from .storage import Storage

_PREFIX = "ckpt_plugins_meta-"  # apart from the segments (ckpt_plugins-<pid>-<hex>)


class HostMetadata:
    """The metadata of `storage`, read once per host; owns the copy it published."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.published: Optional[str] = None

    def read(self) -> Metadata:
        if shm.host_key() is None:  # no shared-memory directory here: each rank reads
            return read_committed(self.storage)[0]
        directory = shm.shm_dir()
        name = _PREFIX + hashlib.sha256(self.storage.identity.encode()).hexdigest()[:24]
        lock_path = os.path.join(directory, name + ".lock")
        try:
            fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o600)
        except OSError:  # a full or read-only directory: read from storage
            return read_committed(self.storage)[0]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = _published(directory, name)
            if data is not None:
                return decode_metadata(data)  # its publisher checked the files
            metadata, data = read_committed(self.storage)
            if data is not None:
                self.published = _publish(directory, name, data)
            return metadata
        finally:
            # Ranks already waiting keep the unlinked lock; one coming later takes a fresh one and
            # finds the copy. Without a copy two may then read the storage: only a repeated read.
            try:
                os.unlink(lock_path)
            except FileNotFoundError:
                pass
            os.close(fd)  # releases the lock

    def release(self) -> None:
        """Remove the published copy (once every rank of the host has read it)."""
        if self.published is not None:
            try:
                os.unlink(self.published)
            except FileNotFoundError:
                pass
        self.published = None


def _published(directory: str, name: str) -> Optional[bytes]:
    """The bytes a live rank of this host published under `name`; copies of dead ranks are removed."""
    for entry in os.listdir(directory):
        if not entry.startswith(name + "-"):
            continue
        path = os.path.join(directory, entry)
        pid = entry[len(name) + 1:]
        if pid.isdigit() and shm.alive(int(pid)):
            try:
                with open(path, "rb") as f:
                    return f.read()
            except FileNotFoundError:  # released meanwhile by another job's load of the same path
                continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return None


def _publish(directory: str, name: str, data: bytes) -> Optional[str]:
    """The path of the copy left for the host's other ranks; None when there is no room for it
    (they then read the storage themselves)."""
    path = os.path.join(directory, f"{name}-{os.getpid()}")
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # whole or absent
        return path
    except OSError:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        return None
