"""The Checkpointer: one per process group; saves (sync, async, overlapped) and loads.

It owns what outlives one save: the staging pool, the plan cache, the background thread that
writes and commits saves in order, and the two gloo groups it coordinates on (foreground
planning/loading in the caller's thread; background commits on their own group, so they never
interleave with the training job's collectives or with the next save's planning).
"""
from __future__ import annotations

import hashlib
import logging
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .dist import Coordinator
from .engine import StagedWrite, StageItem, read_checked, read_items
from .errors import (CheckpointError, CorruptCheckpointError, IncompleteCheckpointError, LoadMismatchError,
                     MetadataError, NotACheckpointError, SaveError, UnsafePathError)
from .fragment import sub_view
from .format import DATA_DIR, METADATA_FILE, Metadata, ObjectMeta, decode_metadata, dtype_name
from . import lock, shm
from .objects import decode_object, encode_object
from .plan import (SavePlan, TensorSpec, WriteItem, assign_transfers, candidate_keys, place, plan_load,
                   plan_save, read_request, resolve_key)
from .staging import StagingPool
from .state import LoadItems, root_handler
from .storage import Storage, storage_for

log = logging.getLogger("ckpt_plugins")
_HOST = shm.host_key()


@dataclass
class SaveInfo:
    """What a save did, on this rank: bytes, the plan's balance, collectives, timings (s)."""
    rank_bytes: int = 0
    total_bytes: int = 0
    balance: float = 1.0  # max/mean bytes written per rank
    plan_cached: bool = False
    collectives: int = 0  # foreground (planning) collectives of this save
    timings: Dict[str, float] = field(default_factory=dict)


@dataclass
class LoadResult:
    missing_keys: List[str] = field(default_factory=list)
    unexpected_keys: List[str] = field(default_factory=list)
    kept_per_rank: List[str] = field(default_factory=list)  # per-rank objects no rank like ours saved
    read_bytes: int = 0  # bytes this rank read from storage
    collectives: int = 0


class SaveHandle:
    """An in-flight save. `wait_snapshot()` before mutating the saved state; `wait()` for the commit."""

    def __init__(self, path: str):
        self.path = path
        self.info = SaveInfo()
        self._snapshot = threading.Event()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def _fail(self, exc: BaseException) -> None:
        self._error = self._error or exc
        self._snapshot.set()
        self._done.set()

    def wait_snapshot(self) -> None:
        """Block until the saved tensors have been copied; then training may modify them."""
        self._snapshot.wait()
        if self._error is not None and not self._done.is_set():
            raise self._error

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> SaveInfo:
        """Block until committed; raises the save's error (on every rank, naming the failing rank)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"save to {self.path} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.info


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _raise_first(coord: Coordinator, errors: List[Optional[str]]) -> None:
    """Raise, on every rank, the first rank's error, keeping its CheckpointError subclass."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return
    rank, message = failed[0]
    kind, _, text = message.partition(": ")
    cls = {c.__name__: c for c in (CorruptCheckpointError, LoadMismatchError, IncompleteCheckpointError,
                                   NotACheckpointError, MetadataError, UnsafePathError, SaveError)}.get(kind)
    where = "" if coord.world_size == 1 else f"rank {rank}: "
    raise cls(where + text) if cls else CheckpointError(where + message)


def _specs(fragments) -> List[TensorSpec]:
    return [TensorSpec(f.key, tuple(f.global_shape), dtype_name(f.dtype), tuple(f.offsets), tuple(f.lengths),
                       tuple(f.sources), f.cast)
            for f in fragments]


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


def prepare_destination(storage: Storage, overwrite: bool) -> None:
    """Make `storage` ready for a new save: take the save lock (released by `lock.release` once the
    save committed or failed), refuse (or uncommit) a committed checkpoint, drop the data of an
    earlier save that never committed, create the namespace."""
    storage.prepare()
    lock.acquire(storage)
    try:
        if storage.exists(METADATA_FILE):
            if not overwrite:
                raise SaveError(f"{storage} already holds a committed checkpoint; pass overwrite=True "
                                "or save to a new path")
            storage.remove(METADATA_FILE)  # uncommit first: a crash now leaves an incomplete save
        storage.remove(DATA_DIR)
    except BaseException:
        lock.release(storage)
        raise


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


@dataclass
class _CachedPlan:
    key: bytes
    writes: List[WriteItem]
    rank_bytes: int
    plan: Optional[SavePlan]  # the coordinator's global plan (None elsewhere)
    balance: float


class Checkpointer:
    """Saves and loads for the ranks of one process group (every rank calls every method).

    `threads`: writer threads (and data files) per rank. `read_threads`: concurrent reads per rank;
    more than the cores, since reads mostly wait on the device and it serves deeper queues faster
    (1 -> 4 threads took a 1 GiB cold load from 2.1-2.6 s to 1.2-1.6 s here). `shared_memory`:
    ranks on one host pass read-once ranges through /dev/shm rather than the process group.
    """

    def __init__(self, process_group=None, *, threads: int = 2, read_threads: int = 4,
                 staging_cap_bytes: Optional[int] = None, direct_io: bool = True, shared_memory: bool = True,
                 timeout: timedelta = timedelta(minutes=10)):
        self.process_group = process_group
        self.shared_memory = shared_memory
        self.threads = threads
        self.read_threads = read_threads
        self.direct_io = direct_io
        self.timeout = timeout
        self.pool = StagingPool(staging_cap_bytes)
        self._fg: Optional[Coordinator] = None
        self._bg: Optional[Coordinator] = None
        self._cache: Optional[_CachedPlan] = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit")  # saves commit in order
        self._last: Optional[SaveHandle] = None

    # ------------------------------------------------------------ coordination groups

    def _groups(self) -> Coordinator:
        """Foreground coordinator; creates the checkpoint's own gloo groups on first use."""
        if self._fg is None:
            base = Coordinator(self.process_group)
            if not base.active or base.world_size == 1:
                self._fg, self._bg = base, Coordinator(self.process_group)
            else:
                ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
                # Locally synchronised groups are named from the count of groups each rank is in, which
                # differs across ranks once a framework has made subgroups (Megatron): they would never
                # meet. Over the whole world, plain groups (named by a count every rank keeps) are safe.
                local = len(ranks) != dist.get_world_size()
                fg = dist.new_group(ranks, backend="gloo", timeout=self.timeout, use_local_synchronization=local)
                bg = dist.new_group(ranks, backend="gloo", timeout=self.timeout, use_local_synchronization=local)
                self._fg, self._bg = Coordinator(fg), Coordinator(bg)
        return self._fg

    # ------------------------------------------------------------ save

    def save(self, path, state: Dict[str, Any], *, async_: bool = False, overlap: bool = False,
             framework: str = "torch", layout: Optional[Dict[str, Any]] = None, step: Optional[int] = None,
             overwrite: bool = False, on_commit: Optional[Callable[[], None]] = None):
        """Save `state` to `path`. Sync: returns SaveInfo once committed. `async_=True`: returns a
        SaveHandle once the snapshot is taken. `overlap=True`: returns a SaveHandle at once, the
        snapshot running in the background; call `wait_snapshot()` before the next optimizer step.
        `on_commit()` runs on the coordinating rank right after the commit, before the save counts
        as done (a "latest" pointer, retention); its failure is the save's error.
        """
        coord = self._groups()
        storage = storage_for(path, direct_io=self.direct_io)
        if self._last is not None and self._last.path == str(storage):
            _quiet_wait(self._last)  # never clean up under a save still writing here
        t0 = time.perf_counter()
        before = coord.collectives
        handle = SaveHandle(str(storage))
        error = None
        fragments, objects, aliases, specs = [], [], {}, []
        try:
            items = root_handler(state).save_items("")
            fragments, aliases = items.fragments, items.aliases
            mine = list(items.objects.items()) if coord.is_coordinator else []
            for (key, value), rank in [(kv, None) for kv in mine] + [(kv, coord.rank) for kv in items.per_rank.items()]:
                encoding, data = encode_object(value)
                objects.append((key, encoding, data, rank))
            specs = _specs(fragments)
        except Exception as exc:  # every rank must learn of it, or the others would wait forever
            error = _describe(exc)
        obj_file = f"{DATA_DIR}/r{coord.rank}-objects.bin"
        placed, _ = place([len(o[2]) for o in objects], [obj_file])
        info, slot = handle.info, []

        def staged(cached: _CachedPlan) -> StagedWrite:
            return StagedWrite(storage, [StageItem(w.file, w.offset, sub_view(fragments[w.index].local,
                                                                               fragments[w.index].offsets, w.box))
                                         for w in cached.writes] +
                               [StageItem(f, off, o[2]) for o, (f, off) in zip(objects, placed)])

        def copy(job: StagedWrite) -> None:  # a failure reaches every rank through the writes and the commit
            t = time.perf_counter()
            try:
                pin = any(isinstance(i.source, torch.Tensor) and i.source.device.type == "cuda" for i in job.items)
                slot.append(self.pool.acquire(job.nbytes, pin=pin))  # may wait for an earlier save's slot
                job.snapshot(slot[0].buffer, threads=torch.get_num_threads())
            except BaseException as exc:
                job.fail(exc)
                log.error("snapshot for %s failed: %s", storage, _describe(exc))
            finally:
                info.timings["snapshot"] = time.perf_counter() - t

        early: List[StagedWrite] = []

        def speculate(cached: _CachedPlan) -> None:
            # An async save copies with this rank's cached plan while the ranks agree that every
            # cached plan still holds: the agreement then costs the stall nothing.
            early.append(staged(cached))
            copy(early[0])

        try:
            cached, info.plan_cached = self._plan(coord, storage, specs, aliases, error, overwrite,
                                                  meanwhile=speculate if async_ and not overlap else None)
        except BaseException:
            if slot:
                slot.pop().release()
            raise
        t_plan = time.perf_counter()
        copied = bool(early) and info.plan_cached
        if copied:
            job = early[0]
        else:
            if slot:  # copied for a plan another rank's change made stale: copy again
                slot.pop().release()
            job = staged(cached)
        info.rank_bytes, info.balance = sum(item.nbytes for item in job.items), cached.balance
        info.collectives = coord.collectives - before
        info.timings["plan"] = t_plan - t0

        def snapshot() -> None:
            try:
                if not copied:
                    copy(job)
            finally:
                handle._snapshot.set()

        object_entries = [(key, ObjectMeta(file=f, offset=off, nbytes=len(data), crc32c=[], encoding=enc, rank=rank))
                          for (key, enc, data, rank), (f, off) in zip(objects, placed)]
        meta_extra = dict(framework=framework, layout=dict(layout or {}), step=step)
        self._last = handle
        if overlap:
            threading.Thread(target=snapshot, name="ckpt-snapshot", daemon=True).start()

        def start_writes() -> None:  # the writers follow the snapshot's progress piece by piece
            self._executor.submit(self._write_and_commit, handle, storage, job, slot, cached,
                                  object_entries, meta_extra, len(cached.writes), on_commit)

        if async_ and not overlap:
            snapshot()  # training waits for this alone: it gets the cores to itself
            start_writes()
        else:
            start_writes()
            if not overlap:
                snapshot()  # sync: writing starts while the later tensors are still being copied
        info.timings["stall"] = time.perf_counter() - t0
        if async_ or overlap:
            return handle
        return handle.wait()

    def _plan(self, coord: Coordinator, storage: Storage, specs: List[TensorSpec], aliases: Dict[str, str],
              error: Optional[str], overwrite: bool,
              meanwhile: Optional[Callable[[_CachedPlan], None]] = None) -> Tuple[_CachedPlan, bool]:
        """This rank's writes. One all-reduce decides whether every rank's cached plan still holds;
        only when it does not are specs gathered and a new plan scattered. `meanwhile(cached)` runs
        while the all-reduce is in flight, when this rank's own cached plan holds."""
        key = hashlib.sha256(pickle.dumps((specs, sorted(aliases.items()), self.threads))).digest()
        locked = False
        if coord.is_coordinator and error is None:
            try:
                prepare_destination(storage, overwrite)
                locked = True
            except Exception as exc:
                error = str(exc) if isinstance(exc, SaveError) else _describe(exc)
        stale = self._cache is None or self._cache.key != key
        flags = torch.tensor([int(stale), int(error is not None)])
        agreement = None
        if coord.world_size > 1:
            coord.collectives += 1
            agreement = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=coord.group, async_op=True)
        if meanwhile is not None and not stale and error is None:
            try:
                meanwhile(self._cache)
            finally:
                if agreement is not None:
                    agreement.wait()
        elif agreement is not None:
            agreement.wait()
        if flags[1]:
            if locked:
                lock.release(storage)
            errors = coord.all_gather(error)
            failed = [(r, e) for r, e in enumerate(errors) if e]
            raise SaveError(f"rank {failed[0][0]}: {failed[0][1]}; nothing was saved")
        if not flags[0]:
            return self._cache, True
        gathered = coord.gather((specs, aliases, key))
        status = None
        if coord.is_coordinator:
            try:
                plan = plan_save([g[0] for g in gathered], files_per_rank=self.threads,
                                 aliases={k: v for g in gathered for k, v in g[1].items()},
                                 digests=[g[2] for g in gathered])
                status = [("ok", w, plan.rank_bytes[r], plan.balance) for r, w in enumerate(plan.writes)]
            except Exception as exc:
                status = [("error", _describe(exc), 0, 0.0)] * coord.world_size
        kind, writes, rank_bytes, balance = coord.scatter(status)
        if kind == "error":
            if locked:
                lock.release(storage)
            raise SaveError(f"planning failed: {writes}; nothing was saved")
        self._cache = _CachedPlan(key, writes, rank_bytes, plan if coord.is_coordinator else None, balance)
        return self._cache, False

    def _write_and_commit(self, handle: SaveHandle, storage: Storage, job: StagedWrite, slot,
                          cached: _CachedPlan, object_entries, meta_extra, n_tensor_items: int,
                          on_commit: Optional[Callable[[], None]]) -> None:
        bg, info = self._bg, handle.info
        t = time.perf_counter()
        try:
            checksums = job.write(self.threads)
            result = ("ok", checksums, job.sizes)
        except Exception as exc:
            result = ("error", f"{_describe(exc)} (writing {', '.join(sorted(job.sizes)) or 'nothing'})", None)
        finally:
            handle._snapshot.wait()  # the snapshot has taken its slot (or failed) and stopped copying
            if slot:
                slot[0].release()
        info.timings["write"] = time.perf_counter() - t
        t = time.perf_counter()
        try:
            for (_, entry), crc in zip(object_entries, (result[1] or [])[n_tensor_items:] if result[0] == "ok" else []):
                entry.crc32c = crc
            results = bg.gather((result[0], result[1][:n_tensor_items] if result[0] == "ok" else result[1],
                                 object_entries, result[2]))
            outcome = self._commit(storage, cached.plan, results, meta_extra, on_commit) if bg.is_coordinator else None
            commit, info.total_bytes = bg.broadcast(outcome)
        except Exception as exc:  # a broken coordination group: this rank cannot know the outcome
            commit = f"coordination failed: {_describe(exc)}; the save may not be committed"
        info.timings["commit"] = time.perf_counter() - t
        if commit:
            handle._fail(SaveError(commit))
            log.error("save to %s failed: %s", storage, commit)
            return
        handle._done.set()

    def _commit(self, storage: Storage, plan: SavePlan, results, meta_extra,
                on_commit: Optional[Callable[[], None]]) -> Tuple[Optional[str], int]:
        """Write the metadata if every rank succeeded: (error or None, checkpoint bytes). Either way
        the save lock is released."""
        try:
            return self._commit_locked(storage, plan, results, meta_extra, on_commit)
        finally:
            lock.release(storage)

    def _commit_locked(self, storage: Storage, plan: SavePlan, results, meta_extra,
                       on_commit: Optional[Callable[[], None]]) -> Tuple[Optional[str], int]:
        failed = [(r, res[1]) for r, res in enumerate(results) if res[0] == "error"]
        if failed:
            return f"rank {failed[0][0]} failed to write: {failed[0][1]}; nothing was committed", 0
        try:
            # Commits run one at a time on this thread, so the cached plan's entries can take
            # this save's checksums in place; objects and file sizes are this save's own.
            objects, files = {}, dict(plan.metadata.files)
            for rank, (_, checksums, object_entries, sizes) in enumerate(results):
                for entry, crc in zip(plan.stored[rank], checksums):
                    entry.crc32c = crc
                for key, entry in object_entries:
                    objects.setdefault(key, []).append(entry)
                files.update(sizes)
            metadata = Metadata(tensors=plan.metadata.tensors, objects=dict(sorted(objects.items())),
                                files=dict(sorted(files.items())), aliases=plan.metadata.aliases,
                                world_size=plan.metadata.world_size, chunk_bytes=plan.metadata.chunk_bytes,
                                **meta_extra)
            storage.prepare()
            storage.put_atomic(METADATA_FILE, metadata.to_json())
        except Exception as exc:
            return f"commit failed: {_describe(exc)}; nothing was committed", 0
        if on_commit is not None:
            try:
                on_commit()
            except Exception as exc:
                return f"{storage} is committed, but the step after the commit failed: {_describe(exc)}", 0
        return None, metadata.total_bytes

    def wait(self) -> None:
        """Wait for the last save's commit (raising its error)."""
        if self._last is not None:
            self._last.wait()

    def close(self) -> None:
        """Let pending saves finish, then release the background thread and the checkpoint groups."""
        self._executor.shutdown(wait=True)
        self._fg = self._bg = None

    # ------------------------------------------------------------ load

    def load(self, path, state: Dict[str, Any], *, strict: bool = True) -> LoadResult:
        """Load a checkpoint into `state` in place, resharding to whatever layout `state` has.

        Every check the metadata allows (format, version, paths, keys, shapes, dtypes, coverage,
        file sizes) runs on every rank before any tensor is touched. A stored range several ranks
        need is read by one of them and sent to the others.
        """
        coord = self._groups()
        storage = storage_for(path, direct_io=self.direct_io)
        if self._last is not None and self._last.path == str(storage):
            _quiet_wait(self._last)
        created: List[LoadItems] = []
        try:
            return self._load(coord, storage, state, strict, created)
        except BaseException:
            for undo in created[0].undo if created else []:
                undo()  # state this load created (optimizer moments) does not outlive it
            raise

    def _load(self, coord: Coordinator, storage: Storage, state: Dict[str, Any], strict: bool,
              created: List[LoadItems]) -> LoadResult:
        before = coord.collectives
        error, wanted, missing, plan, metadata, items, requests = None, [], [], None, None, None, []
        try:
            metadata = read_metadata(storage)
            check_files(storage, metadata)
            items = root_handler(state).load_items("", metadata)
            created.append(items)
            specs = _specs(items.fragments)
            plan = plan_load(metadata, specs)
            # every stored candidate of a wanted tensor counts as used: a bf16 weight is not left
            # over when its fp32 master filled the model
            wanted = sorted({resolve_key(metadata, k) for s in specs for k in candidate_keys(s)}
                            | {s.key for s in specs} | set(items.objects) | set(items.per_rank) | items.accepted)
            missing = plan.missing + [k for k in items.objects if k not in metadata.objects]
            requests = [read_request(r) for r in plan.reads]
        except Exception as exc:  # every rank must learn of it, or the others would wait forever
            error = _describe(exc)
        gathered = coord.all_gather((error, wanted, missing, requests, _HOST))
        _raise_first(coord, [g[0] for g in gathered])

        stored = set(metadata.tensors) | set(metadata.objects) | set(metadata.aliases)
        result = LoadResult(missing_keys=sorted({k for g in gathered for k in g[2]}),
                            unexpected_keys=sorted(stored - {k for g in gathered for k in g[1]}))
        if strict and (result.missing_keys or result.unexpected_keys):
            raise LoadMismatchError(_key_report(result))

        shared = assign_transfers([g[3] for g in gathered])
        transfers = {i: shared[req[:2]] for i, req in enumerate(requests) if req[:2] in shared}
        hosts = [g[4] for g in gathered]  # ranks of one host exchange through shared memory
        if not (shared and self.shared_memory and any(h is not None and hosts.count(h) > 1 for h in hosts)):
            hosts = None
        error = None
        try:
            result.read_bytes = read_items(storage, plan.reads, items.fragments,
                                           {k: m.dtype for k, m in metadata.tensors.items()},
                                           metadata.chunk_bytes, self.read_threads, transfers, coord.rank, coord.group,
                                           hosts)
            coord.collectives += hosts is not None  # the ranks agreed on who shares memory
            for key, setter in items.objects.items():
                if key in metadata.objects:
                    setter(read_object(storage, metadata, key, None))
            for key, setter in items.per_rank.items():
                if any(o.rank == coord.rank for o in metadata.objects.get(key, [])):
                    setter(read_object(storage, metadata, key, coord.rank))
                else:
                    result.kept_per_rank.append(key)
                    log.warning("%s: the checkpoint has no value saved by rank %d; keeping the current one",
                                key, coord.rank)
            for finish in items.finish:
                finish()
        except Exception as exc:
            error = _describe(exc)
        _raise_first(coord, coord.all_gather(error))
        result.collectives = coord.collectives - before
        return result


def _quiet_wait(handle: SaveHandle) -> None:
    try:
        handle.wait()
    except Exception:
        pass  # its own wait() reports it


def read_object(storage: Storage, metadata: Metadata, key: str, rank: Optional[int]) -> Any:
    entry = next(o for o in metadata.objects[key] if o.rank == rank)
    data = read_checked(storage, key, entry.file, entry.offset, entry.nbytes, 0, entry.nbytes,
                        entry.crc32c, metadata.chunk_bytes)
    return decode_object(key, entry.encoding, bytes(data))


def _key_report(result: LoadResult) -> str:
    parts = []
    for what, keys in (("missing from the checkpoint", result.missing_keys),
                       ("in the checkpoint but not in the state", result.unexpected_keys)):
        if keys:
            shown = ", ".join(keys[:10]) + (f", ... ({len(keys)} in all)" if len(keys) > 10 else "")
            parts.append(f"keys {what}: {shown}")
    return "; ".join(parts) + ". Pass strict=False to load the rest and get these back."
