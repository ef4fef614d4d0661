"""Storage backends (`base.Storage`): local directories, fsspec filesystems (S3, GCS, HDFS,
memory, ...), and any backend registered for a URL scheme."""
from __future__ import annotations

import os
from typing import Callable, Dict

from .base import Storage, Writer, durable
from .local import LocalStorage
from .stream import AlignedStream

__all__ = ["Storage", "Writer", "LocalStorage", "AlignedStream", "durable", "storage_for", "register_scheme"]

_SCHEMES: Dict[str, Callable[[str], Storage]] = {}


def register_scheme(scheme: str, factory: Callable[[str], Storage]) -> None:
    """Make `factory(url)` the Storage of every `scheme://...` path."""
    _SCHEMES[scheme] = factory


def storage_for(path, direct_io: bool = True) -> Storage:
    """The backend for a path: a Storage passes through; `file://` and plain paths are local
    directories; a registered scheme goes to its factory; any other `scheme://` goes through
    fsspec (s3://, gs://, hdfs://, memory://, ...)."""
    if isinstance(path, Storage):
        return path
    path = os.fspath(path)
    if path.startswith("file://"):
        path = path[len("file://"):]
    elif "://" in path:
        scheme = path.split("://", 1)[0]
        if scheme in _SCHEMES:
            return _SCHEMES[scheme](path)
        from .fsspec import FsspecStorage  # imported on first use: fsspec and its backends are optional
        return FsspecStorage(path)
    return LocalStorage(path, direct_io=direct_io)
