"""The commit protocol, one object for online saves, offline tools and the extensions alike.

`Commit.open` takes the path's save lock and readies the destination (uncommitting a checkpoint
it may overwrite, dropping the data of a save that never committed); `commit` writes the metadata
atomically, which is the commit; `close` releases the lock, committed or not. The object owns
the lock from `open` to `close`: nothing else releases it.
"""
from __future__ import annotations

from . import lock
from .errors import SaveError
from .format import DATA_DIR, METADATA_FILE, Metadata
from .storage import Storage


class Commit:
    def __init__(self, storage: Storage):
        self.storage = storage
        self._locked = False

    @classmethod
    def open(cls, storage: Storage, overwrite: bool = False) -> "Commit":
        """Lock `storage` for a new save and make it ready; raises SaveError where it may not be
        written (a committed checkpoint without `overwrite`, another live save)."""
        commit = cls(storage)
        storage.prepare()
        lock.acquire(storage)
        commit._locked = True
        try:
            if storage.exists(METADATA_FILE):
                if not overwrite:
                    raise SaveError(f"{storage} already holds a committed checkpoint; pass overwrite=True "
                                    "or save to a new path")
                storage.remove(METADATA_FILE)  # uncommit first: a crash now leaves an incomplete save
            storage.remove(DATA_DIR)
        except BaseException:
            commit.close()
            raise
        return commit

    def commit(self, metadata: Metadata) -> None:
        """Write the metadata (temp file, fsync, rename): from here on the checkpoint loads."""
        self.storage.prepare()
        self.storage.put_atomic(METADATA_FILE, metadata.to_json())

    def close(self) -> None:
        """Release the save lock (once); the data stays, committed or not."""
        if self._locked:
            self._locked = False
            lock.release(self.storage)

    def __enter__(self) -> "Commit":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

