"""`save` and `load`: the public entry points every framework extension goes through."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .dist import Coordinator
from .engine import read_checked, read_items, write_items
from .errors import (CheckpointError, CorruptCheckpointError, IncompleteCheckpointError,
                     LoadMismatchError, MetadataError, NotACheckpointError, SaveError, UnsafePathError)
from .format import DATA_DIR, METADATA_FILE, Metadata, decode_metadata, dtype_name
from .objects import decode_object, encode_object
from .plan import ObjectSpec, TensorSpec, plan_load, plan_save
from .state import root_handler
from .storage import Storage, storage_for

log = logging.getLogger("ckpt_plugins")


@dataclass
class SaveInfo:
    """What a save did, on this rank: bytes it wrote, the plan's balance, timings (s)."""
    rank_bytes: int
    total_bytes: int
    balance: float  # max/mean bytes per rank
    collectives: int
    timings: Dict[str, float] = field(default_factory=dict)


@dataclass
class LoadResult:
    missing_keys: List[str] = field(default_factory=list)
    unexpected_keys: List[str] = field(default_factory=list)
    kept_per_rank: List[str] = field(default_factory=list)  # per-rank objects saved by no rank like ours
    read_bytes: int = 0
    collectives: int = 0


def _specs(fragments) -> List[TensorSpec]:
    return [TensorSpec(f.key, tuple(f.global_shape), dtype_name(f.dtype), tuple(f.offsets), tuple(f.lengths))
            for f in fragments]


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _raise_first(coord: Coordinator, errors: List[Optional[str]]) -> None:
    """Raise, on every rank, the first rank's error, keeping its CheckpointError subclass."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return
    rank, message = failed[0]
    kind, _, text = message.partition(": ")
    cls = {c.__name__: c for c in (CorruptCheckpointError, LoadMismatchError, IncompleteCheckpointError,
                                   NotACheckpointError, MetadataError, UnsafePathError)}.get(kind)
    where = "" if coord.world_size == 1 else f"rank {rank}: "
    raise cls(where + text) if cls else CheckpointError(where + message)


def save(path, state: Dict[str, Any], *, process_group=None, framework: str = "torch",
         layout: Optional[Dict[str, Any]] = None, step: Optional[int] = None, threads: int = 2,
         overwrite: bool = False) -> SaveInfo:
    """Save `state` (modules, optimizers, tensors, objects) to `path`, collectively.

    Every rank of `process_group` calls it. Returns after the checkpoint is committed; raises
    SaveError on every rank if any rank failed, and then nothing is committed.
    """
    coord = Coordinator(process_group)
    storage = storage_for(path)
    timings: Dict[str, float] = {}
    t0 = time.perf_counter()
    error = None
    try:
        items = root_handler(state).save_items("")
        fragments = items.fragments
        encoded = []
        object_specs = []
        owned = list(items.objects.items()) if coord.is_coordinator else []
        for (key, value), rank in [(kv, None) for kv in owned] + [(kv, coord.rank) for kv in items.per_rank.items()]:
            encoding, data = encode_object(value)
            encoded.append(data)
            object_specs.append(ObjectSpec(key, len(data), encoding, rank))
        specs = _specs(fragments)
    except Exception as exc:  # reported through the gather so every rank fails together
        error, specs, object_specs, items = _describe(exc), [], [], None
    gathered = coord.gather((specs, object_specs, items.aliases if items else {}, error))
    timings["collect"] = time.perf_counter() - t0

    writes = None
    if coord.is_coordinator:
        failures = [(r, g[3]) for r, g in enumerate(gathered) if g[3]]
        try:
            if failures:
                raise SaveError(f"rank {failures[0][0]} could not describe its state: {failures[0][1]}")
            plan = plan_save([g[0] for g in gathered], [g[1] for g in gathered], files_per_rank=threads,
                             aliases={k: v for g in gathered for k, v in g[2].items()})
            plan.metadata.framework, plan.metadata.layout, plan.metadata.step = framework, dict(layout or {}), step
            _prepare(storage, overwrite)
            writes = [("ok", w, plan.rank_bytes[r]) for r, w in enumerate(plan.writes)]
        except Exception as exc:
            message = str(exc) if isinstance(exc, SaveError) else _describe(exc)
            writes = [("error", message, 0)] * coord.world_size
    status, my_writes, my_bytes = coord.scatter(writes)
    timings["plan"] = time.perf_counter() - t0 - timings["collect"]
    if status == "error":
        raise SaveError(my_writes)

    t1 = time.perf_counter()
    try:
        result = ("ok", write_items(storage, my_writes, fragments, encoded))
    except Exception as exc:
        files = sorted({w.file for w in my_writes})
        result = ("error", f"{_describe(exc)} (writing {', '.join(files)})")
    timings["write"] = time.perf_counter() - t1
    results = coord.gather(result)

    commit = None
    if coord.is_coordinator:
        failed = [(r, res[1]) for r, res in enumerate(results) if res[0] == "error"]
        if failed:
            commit = f"rank {failed[0][0]} failed to write: {failed[0][1]}; nothing was committed"
        else:
            try:
                for rank, (_, checksums) in enumerate(results):
                    for entry, crc in zip(plan.stored[rank], checksums):
                        entry.crc32 = crc
                storage.put_atomic(METADATA_FILE, plan.metadata.to_json())
            except Exception as exc:
                commit = f"commit failed: {_describe(exc)}; nothing was committed"
    commit = coord.broadcast(commit)
    timings["commit"] = time.perf_counter() - t1 - timings["write"]
    if commit:
        raise SaveError(commit)
    totals = coord.broadcast((plan.metadata.total_bytes, plan.balance) if coord.is_coordinator else None)
    return SaveInfo(rank_bytes=my_bytes, total_bytes=totals[0], balance=totals[1],
                    collectives=coord.collectives, timings=timings)


def _prepare(storage: Storage, overwrite: bool) -> None:
    """Make `storage` ready for a new save: refuse to clobber a committed one unless asked."""
    if storage.exists(METADATA_FILE):
        if not overwrite:
            raise SaveError(f"{storage} already holds a committed checkpoint; pass overwrite=True "
                            "or save to a new path")
        storage.remove(METADATA_FILE)  # uncommit first, so a crash below leaves an incomplete save
    storage.remove(DATA_DIR)  # leftovers of an earlier save at this path
    storage.prepare()


def read_metadata(path) -> Metadata:
    """The committed metadata at `path`, validated; raises a clear CheckpointError otherwise."""
    storage = storage_for(path)
    try:
        if storage.exists(METADATA_FILE):
            return decode_metadata(storage.read_bytes(METADATA_FILE))
        if storage.exists(DATA_DIR):
            raise IncompleteCheckpointError(
                f"{storage} is an incomplete checkpoint: its save never committed (no {METADATA_FILE}). "
                "It cannot be loaded; load an earlier checkpoint and delete this one")
        raise NotACheckpointError(f"{storage} is not a ckpt_plugins checkpoint (no {METADATA_FILE})")
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


def load(path, state: Dict[str, Any], *, process_group=None, strict: bool = True,
         threads: int = 2) -> LoadResult:
    """Load a checkpoint into `state` in place, resharding to whatever layout `state` has.

    Every check the metadata allows (format, version, paths, keys, shapes, dtypes, coverage,
    file sizes) runs on every rank before any tensor is touched.
    """
    coord = Coordinator(process_group)
    storage = storage_for(path)
    error, wanted, missing, plan, metadata, items = None, [], [], None, None, None
    try:
        metadata = read_metadata(storage)
        check_files(storage, metadata)
        items = root_handler(state).load_items("", metadata)
        plan = plan_load(metadata, _specs(items.fragments))
        wanted = {f.key for f in items.fragments} | set(items.objects) | set(items.per_rank) | items.accepted
        missing = plan.missing + [k for k in items.objects if k not in metadata.objects]
    except Exception as exc:  # every rank must learn of it, or the others would wait forever
        error = _describe(exc)
    gathered = coord.all_gather((error, sorted(wanted), missing))
    _raise_first(coord, [g[0] for g in gathered])

    stored = set(metadata.tensors) | set(metadata.objects) | set(metadata.aliases)
    result = LoadResult(missing_keys=sorted({k for g in gathered for k in g[2]}),
                        unexpected_keys=sorted(stored - {k for g in gathered for k in g[1]}))
    if strict and (result.missing_keys or result.unexpected_keys):
        raise LoadMismatchError(_key_report(result))

    error = None
    try:
        read_items(storage, plan.reads, items.fragments,
                   {k: m.dtype for k, m in metadata.tensors.items()}, metadata.chunk_bytes, threads)
        result.read_bytes = plan.read_bytes
        for key, setter in items.objects.items():
            if key in metadata.objects:
                setter(_read_object(storage, metadata, key, None))
        for key, setter in items.per_rank.items():
            if any(o.rank == coord.rank for o in metadata.objects.get(key, [])):
                setter(_read_object(storage, metadata, key, coord.rank))
            else:
                result.kept_per_rank.append(key)
                log.warning("%s: the checkpoint has no value saved by rank %d; keeping the current one",
                            key, coord.rank)
        for finish in items.finish:
            finish()
    except Exception as exc:
        error = _describe(exc)
    _raise_first(coord, coord.all_gather(error))
    result.collectives = coord.collectives
    return result


def _read_object(storage: Storage, metadata: Metadata, key: str, rank: Optional[int]) -> Any:
    entry = next(o for o in metadata.objects[key] if o.rank == rank)
    data = read_checked(storage, key, entry.file, entry.offset, entry.nbytes, 0, entry.nbytes,
                        entry.crc32, metadata.chunk_bytes)
    return decode_object(key, entry.encoding, bytes(data))


def _key_report(result: LoadResult) -> str:
    parts = []
    for what, keys in (("missing from the checkpoint", result.missing_keys),
                       ("in the checkpoint but not in the state", result.unexpected_keys)):
        if keys:
            shown = ", ".join(keys[:10]) + (f", ... ({len(keys)} in all)" if len(keys) > 10 else "")
            parts.append(f"keys {what}: {shown}")
    return "; ".join(parts) + ". Pass strict=False to load the rest and get these back."
