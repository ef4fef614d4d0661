"""Object stores and other fsspec filesystems (`s3://bucket/ckpt`, `gs://…`, `hdfs://…`) as Storage.

The commit never relies on rename: data objects are written first, the metadata object last, and
its presence is the commit (an object PUT is all-or-nothing). Data files are uploaded as multipart
uploads by the fsspec file object (several files per rank upload in parallel); reads are ranged
and run in parallel from the engine's read threads. Every call is retried with exponential backoff
on transient errors (connection resets, timeouts, 5xx, throttling), a bounded number of times
within a bounded time (the client's own retries are off, so that they do not multiply ours);
permanent ones (403, 404, bad credentials) fail at once with the storage's own message.
Credentials come from the standard places (environment, fsspec config, the provider's files): they
are never taken from or written into the checkpoint, and paths are shown without them.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, List, Optional, TypeVar
from urllib.parse import urlsplit, urlunsplit

from ..errors import CorruptCheckpointError, UnsafePathError
from ..optional import require
from .base import Storage, Writer

log = logging.getLogger(__name__)
T = TypeVar("T")

# Error text of retryable S3/HTTP failures (botocore and aiohttp name them in messages and classes).
_TRANSIENT_MARKS = ("SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttl", "503", "500",
                    "502", "504", "Connection reset", "ServerDisconnected", "EndpointConnectionError",
                    "ConnectionClosed", "ReadTimeout", "ResponseStreamingError", "IncompleteRead",
                    "ClientConnectorError", "ClientOSError", "Server disconnected", "ConnectTimeout")


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError)):
        return False
    seen = 0
    while exc is not None and seen < 8:  # s3fs turns an S3 error into an OSError caused by it
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        text = " ".join([c.__name__ for c in type(exc).__mro__] + [str(exc)])
        if any(mark in text for mark in _TRANSIENT_MARKS):
            return True
        exc, seen = exc.__cause__, seen + 1
    return False


def redact(url: str) -> str:
    """`url` without user:password@ (never shown in errors or logs)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    return urlunsplit((parts.scheme, host + (f":{parts.port}" if parts.port else ""), parts.path, parts.query, ""))


class FsspecStorage(Storage):
    def __init__(self, url: str, retries: int = 10, backoff: float = 0.25, max_backoff: float = 8.0,
                 timeout: float = 60.0, **options):
        """`retries` of each operation on transient errors, with backoff from `backoff` up to
        `max_backoff` s; none starts once `timeout` s have passed since the first attempt, so a
        store that stops answering fails an operation within `timeout` plus one attempt (s3fs's
        own timeouts: 5 s to connect, 15 s without data). Enough retries that the time bounds them:
        a store refusing connections for a while (a restart, a failover) fails each attempt at
        once, and 6 retries gave up after 16 s."""
        fsspec = require("fsspec", redact(url))
        if url.startswith("s3://"):
            require("s3fs", redact(url))
        parts = urlsplit(url)
        if parts.username is not None or parts.password is not None:
            # a URL ends up in logs and error messages: credentials belong in the environment or config
            raise ValueError(f"{redact(url)}: credentials in the URL are refused; set them in the environment "
                             "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ...) or the fsspec config")
        self.url = url.rstrip("/")
        self.retries, self.backoff, self.max_backoff, self.timeout = retries, backoff, max_backoff, timeout
        self.retried = 0  # transient failures retried so far (telemetry)
        # no cached listings: other ranks and jobs write into the same prefix
        options.setdefault("skip_instance_cache", True)
        if self.url.startswith("s3://"):
            options.setdefault("use_listings_cache", False)
            # one retry layer, whose time is bounded: botocore's and s3fs's own retries would
            # multiply it (a server that stops answering then held a rank for many minutes)
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("retries", {"mode": "standard", "max_attempts": 1})
            options["config_kwargs"] = config
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        if self.url.startswith("s3://"):
            self.fs.retries = 1  # s3fs's retry loop: one attempt (its constructor's `retries`)
        self.root = self.root.rstrip("/")

    def __str__(self) -> str:
        return redact(self.url)

    def __repr__(self) -> str:
        return f"FsspecStorage({redact(self.url)!r})"

    def path(self, name: str) -> str:
        parts = name.split("/") if name else []
        if name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
            raise UnsafePathError(f"{name!r} is not a plain relative path inside checkpoint {self}")
        return "/".join([self.root] + parts)

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        delay, deadline = self.backoff, time.monotonic() + self.timeout
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as exc:
                if attempt == self.retries or not is_transient(exc) or time.monotonic() + delay > deadline:
                    raise
                log.warning("%s on %s failed (%s: %s); retry %d/%d in %.2f s", what, self, type(exc).__name__,
                            exc, attempt + 1, self.retries, delay)
                self.retried += 1
                time.sleep(delay)
                delay = min(self.max_backoff, delay * 2)
        raise AssertionError("unreachable")

    def open_writer(self, name: str) -> Writer:
        return _RemoteWriter(self, self.path(name))

    def read_into(self, name: str, offset: int, buffer) -> None:
        view = memoryview(buffer).cast("B")
        if not len(view):
            return
        path = self.path(name)
        data = self.retry(f"read {name}", lambda: self.fs.cat_file(path, start=offset, end=offset + len(view)))
        if len(data) != len(view):
            raise CorruptCheckpointError(f"{name} is truncated: wanted bytes {offset}..{offset + len(view)}, "
                                         f"got {len(data)}")
        view[:] = data

    def read_bytes(self, name: str) -> bytes:
        path = self.path(name)
        return self.retry(f"read {name}", lambda: self.fs.cat_file(path))

    def put_atomic(self, name: str, data: bytes) -> None:
        path = self.path(name)
        self.retry(f"write {name}", lambda: self.fs.pipe_file(path, bytes(data)))

    def exists(self, name: str) -> bool:
        path = self.path(name)
        return self.retry(f"stat {name}", lambda: self.fs.exists(path))

    def size(self, name: str) -> int:
        path = self.path(name)
        return int(self.retry(f"stat {name}", lambda: self.fs.size(path)))

    def listdir(self, name: str = "") -> List[str]:
        path = self.path(name)
        try:
            entries = self.retry(f"list {name}", lambda: self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != path})

    def remove(self, name: str) -> None:
        path = self.path(name)
        try:
            if self.retry(f"stat {name}", lambda: self.fs.exists(path)):
                self.retry(f"remove {name}", lambda: self.fs.rm(path, recursive=True))
        except FileNotFoundError:
            pass

    def prepare(self) -> None:
        try:
            self.retry("create", lambda: self.fs.makedirs(self.root, exist_ok=True))
        except FileExistsError:
            pass


class _RemoteWriter(Writer):
    """One object, uploaded in parts while the data arrives (the fsspec file's multipart upload).
    A transient failure fails the file; the save then fails on every rank and nothing is committed."""

    def __init__(self, storage: FsspecStorage, path: str):
        self.storage, self.path = storage, path
        before = storage.retried
        self.file: Optional[object] = storage.retry("open", lambda: storage.fs.open(path, "wb"))
        self.retries = storage.retried - before

    def write(self, data) -> None:
        self.file.write(memoryview(data).cast("B"))

    def close(self) -> None:
        file, self.file = self.file, None
        if file is not None:
            file.close()
