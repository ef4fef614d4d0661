"""Checkpoints built on a base checkpoint: a frozen base (a PEFT run's) is not stored again.

A save given `base=` leaves out every frozen parameter the base checkpoint holds, and stores a
`BaseRef` instead: where the base is and a digest of its metadata. A load follows it: the base's
tensors first, then this checkpoint's, every key check over both before any data moves; a base
that changed since (its metadata differs) is refused, naming both checkpoints.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from typing import List, Optional

from .committed import read_metadata
from .errors import CheckpointError, CorruptCheckpointError
from .format import METADATA_FILE, dtype_name
from .state import SaveItems
from .storage import LocalStorage, Storage, storage_for

BASE = "ckpt_plugins/base"  # the object key of a checkpoint's BaseRef


class BaseChangedError(CheckpointError):
    """The base checkpoint a checkpoint was built on is not the one it was saved against."""


@dataclass
class BaseRef:
    path: str      # the base, relative to the checkpoint when both are local
    digest: str    # sha256 of the base's metadata file
    keys: List[str]  # the stored keys left to the base


def reference(value) -> BaseRef:
    """The stored reference, checked: a foreign or damaged one is an error, not a crash."""
    if not (isinstance(value, dict) and isinstance(value.get("path"), str) and isinstance(value.get("digest"), str)
            and isinstance(value.get("keys"), list) and all(isinstance(k, str) for k in value["keys"])):
        raise CorruptCheckpointError(f"malformed base reference {str(value)[:200]!r}")
    return BaseRef(value["path"], value["digest"], value["keys"])


def digest(storage: Storage) -> str:
    return hashlib.sha256(storage.read_bytes(METADATA_FILE)).hexdigest()


def _local(storage: Storage) -> Optional[str]:
    return str(storage.root) if isinstance(storage, LocalStorage) else None


def relative(storage: Storage, base_storage: Storage, given) -> str:
    """Where a checkpoint in `storage` records its base (`given` as the caller named it): relative
    to it when both are local, so that they move together; else as given."""
    here, there = _local(storage), _local(base_storage)
    return os.path.relpath(there, here) if here and there else str(given)


def leave_to_base(items: SaveItems, base, storage: Storage) -> None:
    """Drop from `items` the frozen tensors `base` holds alike (same shape and dtype), and add the
    reference. Raises if `base` is not a committed checkpoint."""
    base_storage = storage_for(base)
    metadata = read_metadata(base_storage)
    kept, left = [], set()
    for frag in items.fragments:
        stored = metadata.tensors.get(frag.key)
        if frag.key in items.frozen and stored is not None and tuple(stored.shape) == tuple(frag.global_shape) \
                and stored.dtype == dtype_name(frag.dtype):
            left.add(frag.key)
        else:
            kept.append(frag)
    items.fragments = kept
    items.aliases = {k: v for k, v in items.aliases.items() if v not in left}
    items.objects[BASE] = asdict(BaseRef(relative(storage, base_storage, base), digest(base_storage), sorted(left)))


def resolve(storage: Storage, ref: BaseRef) -> Storage:
    """The base's storage, checked against the reference."""
    here = _local(storage)
    path = os.path.normpath(os.path.join(here, ref.path)) if here and not os.path.isabs(ref.path) \
        and "://" not in ref.path else ref.path
    try:
        base = storage_for(path)
        found = digest(base)
    except (OSError, ValueError) as exc:
        raise BaseChangedError(f"{storage} was saved on the base checkpoint {path}, which cannot be read ({exc}); "
                               "restore it there, or load with the base moved back") from None
    if found != ref.digest:
        raise BaseChangedError(f"{storage} was saved on the base checkpoint {path}, which has changed since "
                               f"(metadata digest {found[:12]}, expected {ref.digest[:12]}); load the base it "
                               "was trained on")
    return base
