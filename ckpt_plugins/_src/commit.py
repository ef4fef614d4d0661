"""The commit protocol, one object for online saves, offline tools and the extensions alike.

`Commit.open` takes the path's save lock and readies the destination; `commit` writes the
metadata atomically, which is the commit; `close` releases the lock, committed or not. The object
owns the lock from `open` to `close`: nothing else releases it.

Overwriting a committed checkpoint never makes it unloadable before its replacement commits: the
new save writes its data files under the other *generation*'s names (`data/g1-r0-0.bin` beside
`data/r0-0.bin`), the metadata's atomic replacement switches from the old files to the new ones,
and only then are the old files removed. A crash at any point leaves the old checkpoint or the
new one, whole.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Set

from . import lock
from .errors import CheckpointError, SaveError
from .format import DATA_DIR, METADATA_FILE, Metadata
from .metadata_codec import decode_metadata, encode_metadata
from .storage import Storage

log = logging.getLogger("ckpt_plugins")
GENERATIONS = 2  # alternate between two sets of file names


def generation_file(name: str, generation: int) -> str:
    """Data file `name` of a plan as written by a save of `generation` (0 keeps it)."""
    if not generation:
        return name
    head, _, tail = name.rpartition("/")
    return f"{head}/g{generation}-{tail}" if head else f"g{generation}-{tail}"


def generation_of(metadata: Metadata) -> int:
    """Which generation's names a committed checkpoint's files use."""
    return next((g for g in range(1, GENERATIONS) for f in metadata.files
                 if f.rpartition("/")[2].startswith(f"g{g}-")), 0)


def renamed(metadata: Metadata, generation: int) -> Metadata:
    """`metadata` with every data file reference in `generation`'s names."""
    if not generation:
        return metadata

    def name(item):
        return dataclasses.replace(item, file=generation_file(item.file, generation))

    tensors = {k: dataclasses.replace(t, boxes=[name(b) for b in t.boxes]) for k, t in metadata.tensors.items()}
    objects = {k: [name(o) for o in objs] for k, objs in metadata.objects.items()}
    files = {generation_file(f, generation): n for f, n in metadata.files.items()}
    return dataclasses.replace(metadata, tensors=tensors, objects=objects, files=files)


class Commit:
    def __init__(self, storage: Storage):
        self.storage = storage
        self.generation = 0  # the names this save's data files take (see generation_file)
        self._locked = False

    @classmethod
    def open(cls, storage: Storage, overwrite: bool = False) -> "Commit":
        """Lock `storage` for a new save and make it ready; raises SaveError where it may not be
        written (a committed checkpoint without `overwrite`, another live save). A committed
        checkpoint being overwritten stays whole and loadable until `commit`."""
        commit = cls(storage)
        storage.prepare()
        lock.acquire(storage)
        commit._locked = True
        try:
            previous = commit._committed(overwrite)
            if previous is None:
                storage.remove(DATA_DIR)  # a save that never committed left these
            else:
                commit.generation = (generation_of(previous) + 1) % GENERATIONS
                commit._sweep(set(previous.files))
        except BaseException:
            commit.close()
            raise
        return commit

    def _committed(self, overwrite: bool) -> Optional[Metadata]:
        """The metadata of the committed checkpoint this save replaces; None when there is none
        to keep (an unreadable one is uncommitted first: a crash then leaves an incomplete save)."""
        storage = self.storage
        if not storage.exists(METADATA_FILE):
            return None
        if not overwrite:
            raise SaveError(f"{storage} already holds a committed checkpoint; pass overwrite=True "
                            "or save to a new path")
        try:
            return decode_metadata(storage.read_bytes(METADATA_FILE))
        except (CheckpointError, OSError) as exc:
            log.warning("%s: overwriting a checkpoint whose metadata cannot be read (%s)", storage, exc)
            storage.remove(METADATA_FILE)
            return None

    def _sweep(self, keep: Set[str]) -> None:
        """Remove the data files that `keep` does not name (an older generation's, or a failed save's)."""
        for entry in self.storage.listdir(DATA_DIR):
            name = f"{DATA_DIR}/{entry}"
            if name not in keep:
                self.storage.remove(name)

    def file(self, name: str) -> str:
        """Where this save writes the plan's data file `name`."""
        return generation_file(name, self.generation)

    def commit(self, metadata: Metadata) -> None:
        """Write the metadata (temp file, fsync, rename): from here on the checkpoint loads. Its
        file names are the plan's; they are stored in this save's generation. The files of the
        checkpoint it replaced are removed afterwards (a failure there only logs)."""
        metadata = renamed(metadata, self.generation)
        self.storage.prepare()
        self.storage.put_atomic(METADATA_FILE, encode_metadata(metadata))
        try:
            self._sweep(set(metadata.files))
        except OSError as exc:
            log.warning("%s: committed, but the replaced checkpoint's files could not be removed: %s",
                        self.storage, exc)

    def close(self) -> None:
        """Release the save lock (once); the data stays, committed or not."""
        if self._locked:
            self._locked = False
            lock.release(self.storage)

    def __enter__(self) -> "Commit":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
