"""What a committed checkpoint is, from the reader's side: its metadata (whose presence is the
commit), its data files, its objects. Any storage backend."""
from __future__ import annotations

from typing import Any, Optional, Tuple

from .errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError, NotACheckpointError
from .foreign import ComputedObject, detect, read_foreign, readers
from .format import DATA_DIR, FORMAT_NAME, METADATA_FILE, Metadata
from .metadata_codec import decode_metadata
from .objects import decode_object
from .storage import Storage, storage_for


def _storage(path) -> Storage:
    return path if isinstance(path, Storage) else storage_for(path)


_MARK = b'{"format":"' + FORMAT_NAME.encode() + b'"'  # how every metadata file we write begins


def is_checkpoint(path) -> bool:
    """Whether `path` (a directory, an `s3://` prefix, any storage) holds a committed checkpoint.
    Cheap: it reads the metadata file's first bytes (Megatron's torch_dist directories have a
    metadata.json too); `read_metadata` validates the rest."""
    try:
        storage = _storage(path)
        if not storage.exists(METADATA_FILE) or storage.size(METADATA_FILE) < len(_MARK):
            return False
        head = bytearray(len(_MARK))
        storage.read_into(METADATA_FILE, 0, head)
        return bytes(head) == _MARK
    except (OSError, ValueError, CheckpointError):
        return False


def checkpoint_format(path) -> Optional[str]:
    """What `path` holds, cheaply (marker files): "ckpt_plugins" for a committed checkpoint of ours,
    the name of a format `load` reads in place ("HF safetensors", "PyTorch DCP", ...), else None."""
    storage = _storage(path)
    if is_checkpoint(storage):
        return FORMAT_NAME
    try:
        return detect(storage)
    except (OSError, ValueError, CheckpointError):
        return None


def read_metadata(path) -> Metadata:
    """The committed metadata at `path`, validated; raises a clear CheckpointError otherwise. A
    checkpoint in another format (HF safetensors, PyTorch DCP, ...) gives its foreign view.
    `metadata.tensors` maps each stored key to its `TensorMeta` (shape, dtype, boxes): a read-only
    mapping that builds an entry when it is first looked up."""
    return _read(_storage(path))[0]


def read_committed(storage: Storage) -> Tuple[Metadata, Optional[bytes]]:
    """`read_metadata` with the data files checked (`check_files`), and the metadata's bytes when
    the checkpoint is of this format."""
    metadata, data = _read(storage)
    check_files(storage, metadata)
    return metadata, data


def _read(storage: Storage) -> Tuple[Metadata, Optional[bytes]]:
    """The metadata, and its bytes when they are of this format (the file is read once, its
    marker checked on them)."""
    try:
        data = storage.read_bytes(METADATA_FILE) if storage.exists(METADATA_FILE) else None
        if data is not None and data.startswith(_MARK):
            return decode_metadata(data), data
        foreign = read_foreign(storage)
        if foreign is not None:
            return foreign, None
        if data is not None:
            return decode_metadata(data), None  # says what is wrong with it
        if storage.exists(DATA_DIR):
            raise IncompleteCheckpointError(
                f"{storage} is an incomplete checkpoint: its save never committed (no {METADATA_FILE}). "
                "It cannot be loaded; load an earlier checkpoint and delete this one")
        raise NotACheckpointError(f"{storage} is not a checkpoint ckpt_plugins reads: it has no {METADATA_FILE}, "
                                  f"and is none of the formats read in place ({', '.join(readers())})")
    except OSError as exc:
        raise NotACheckpointError(f"{storage} cannot be read as a checkpoint: {exc}") from None


def check_files(storage: Storage, metadata: Metadata) -> None:
    """Every data file exists and is as long as the metadata says (truncation shows here)."""
    for name, expected in metadata.files.items():
        try:
            size = storage.size(name)
        except OSError:
            raise CorruptCheckpointError(f"data file {name} of {storage} is missing") from None
        if size < expected:
            raise CorruptCheckpointError(f"data file {name} of {storage} is truncated: {size} bytes, "
                                         f"the metadata needs {expected}")


def read_object(storage: Storage, metadata: Metadata, key: str, rank: Optional[int]) -> Any:
    """The object `key` (the replicated one, or rank `rank`'s), checksum-verified and decoded."""
    from .engine.read import read_checked
    entry = next(o for o in metadata.objects[key] if o.rank == rank)
    if isinstance(entry, ComputedObject):
        return entry.compute(storage)
    data = read_checked(storage, key, entry, 0, entry.nbytes, metadata.chunk_bytes)
    return decode_object(key, entry.encoding, bytes(data))


def read_pointer(root, name: str) -> Optional[str]:
    """The text of the small file `name` under `root` (a framework's "latest" pointer: Megatron's
    tracker, DeepSpeed's `latest`), stripped; None when there is none. Any storage backend."""
    storage = _storage(root)
    if not storage.exists(name):
        return None
    return storage.read_bytes(name).decode(errors="replace").strip()
