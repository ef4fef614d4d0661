"""Persisting a committed memory step to durable storage, read from the memory copy: each rank
writes the files it wrote to memory, the coordinator commits the same metadata. No snapshot, so
training does not wait."""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, Optional

from ..commit import Commit, generation_file
from ..coordinator import Coordinator
from ..errors import SaveError
from ..metadata_codec import decode_metadata
from ..storage import Storage, durable
from ..hostmem import aligned_empty
from .hostdir import PIECE, HostDir, pieces

log = logging.getLogger("ckpt_plugins")


def persist(coord: Coordinator, host: HostDir, step: int, files: Dict[str, int], metadata: Optional[bytes],
            target: Storage, *, overwrite: bool, on_commit: Optional[Callable[[], None]]) -> None:
    """Every rank calls it with the files it wrote to memory step `step`; the coordinator passes
    the step's metadata. Raises the same SaveError on every rank if any rank failed; the target
    is committed only when every file is there."""
    what = f"persisting memory step {step} to {target}"
    then = "Nothing was committed there; the step is still in memory"
    t0, opened = time.time(), []

    def lock() -> int:  # the coordinator's generation of file names
        if coord.is_coordinator:
            opened.append(Commit.open(target, overwrite))
            return opened[0].generation
        return 0

    def write(generation: int) -> None:
        buffer = aligned_empty(PIECE)  # page aligned: the writer can bypass the page cache
        for name in sorted(files):
            with durable(target.open_writer(generation_file(name, generation))) as writer:
                for _, offset, n in pieces({name: files[name]}):
                    host.read_piece(step, name, offset, buffer[:n])
                    writer.write(buffer[:n].numpy())

    def commit() -> None:
        if opened:
            opened[0].commit(decode_metadata(metadata))
            if on_commit is not None:
                on_commit()

    try:
        generation = max(coord.agreed(lock, what=what, then=then, default=SaveError))  # locked: write
        coord.agreed(lambda: write(generation), what=what, then=then, default=SaveError)
        coord.agreed(commit, what=what, default=SaveError)
    finally:
        if opened:
            opened[0].close()
    if coord.is_coordinator:
        log.info("persisted memory step %d to %s in %.2f s", step, target, time.time() - t0)
