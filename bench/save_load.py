"""Save/load benchmark: ckpt_plugins against its peers, side by side, in one process tree.

Workload: an FSDP2 (fully_shard) model + AdamW on 2 processes (gloo, CPU), >= 1 GiB of model and
optimizer state. Methods: ours (sync, async, overlapped), torch.save of a rank-0-gathered state
dict, PyTorch DCP save and async_save (plan caching on), and the ByteCheckpoint package when it
imports (bench/peers/bytecheckpoint_peer.py). The machine's own limits are measured in the same
run, in the checkpoint's directory: memcpy into touched memory, O_DIRECT write, cold read (with
O_DIRECT, and through the page cache).

Stall is charged two ways for every method alike: the time the save call blocks, and the extra
wall time of a training loop that saves every k steps (minus the same loop without saves), so a
method that returns early but makes the next step wait pays for it. Loads are timed cold into the
same layout, into another layout at the same world size (FSDP2 sharding columns instead of rows:
every rank needs part of every file) and into one plain process (2 -> 1). Every load is checked
bit for bit. Each checkpoint is deleted after use.

Run: .venv/bin/python bench/save_load.py            (about 20 minutes here)
     .venv/bin/python bench/save_load.py --params-m 8 --reps 1   (a quick smoke run)
     .venv/bin/python bench/save_load.py --methods ours_sync,ours_async,ours_overlap,dcp_save
         (a subset; with PYTHONPATH set to another checkout, the same figures for that version)
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WIDTH = 2048
METHODS = ["ours_sync", "ours_async", "ours_overlap", "torch_save_rank0", "dcp_save", "dcp_async_save",
           "bytecheckpoint"]
PEERS = METHODS[3:]


# ------------------------------------------------------------------ model and training


def build(layers: int, fsdp: bool, dim: int = 0):
    """The model and its optimizer; with `fsdp`, every parameter sharded on `dim` over the ranks."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard
        for layer in model:
            fully_shard(layer, shard_placement_fn=lambda p: Shard(dim))
        fully_shard(model, shard_placement_fn=lambda p: Shard(dim))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model, opt, step: int) -> None:
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def release_memory() -> None:
    """Hand freed memory back to the system: the peers' loads leave GiBs on the heap, and two ranks
    running every method in turn otherwise outgrew 24 GiB here."""
    gc.collect()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).malloc_trim(0)


def local_state(model, opt, dim=None):
    """Every local tensor of model and optimizer, by name: what a same-layout load must restore;
    with `dim`, each as it would be sharded on `dim` (collective)."""
    from torch.distributed.tensor import Shard

    def own(t):
        if dim is not None and hasattr(t, "redistribute"):
            t = t.redistribute(placements=[Shard(dim)])
        return local(t).detach().clone()
    out = {}
    for name, p in model.named_parameters():
        out[f"p/{name}"] = own(p)
        for k, v in opt.state[p].items():
            out[f"o/{name}/{k}"] = own(v)
    return out


def same(a, b) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def drop_cache(path: str) -> None:
    """Evict a checkpoint's files from the page cache so loads read from the disk."""
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


# ------------------------------------------------------------------ methods


class Methods:
    """save(name, path) -> waitable; load(name, path, model, opt) for each method, one rank's view."""

    def __init__(self, world: int, only=None):
        import ckpt_plugins as cp
        self.cp = cp
        self.world = world
        self.only = only
        self.ckpt = cp.Checkpointer(threads=2) if world > 1 else None
        self.gloo = dist.new_group(backend="gloo") if world > 1 else None  # DCP async needs its own group
        self.bcp = None
        try:
            from peers import bytecheckpoint_peer
            bytecheckpoint_peer.apply_patches()
            self.bcp = bytecheckpoint_peer
        except Exception as exc:  # reported in the table
            self.bcp_error = f"{type(exc).__name__}: {exc}"
        self.dcp_planner = None

    @staticmethod
    def wanted(name: str, only) -> bool:
        return not only or name in only

    def available(self, name: str) -> bool:
        return (name != "bytecheckpoint" or self.bcp is not None) and self.wanted(name, self.only)

    def save(self, name: str, path: str, model, opt):
        """Start a save; returns (object to finish it, or None). The call's duration is the stall."""
        state = {"model": model, "optim": opt}
        if name == "ours_sync":
            self.ckpt.save(path, state)
        elif name == "ours_async":
            return self.ckpt.save_async(path, state)
        elif name == "ours_overlap":
            return self.ckpt.save_async(path, state, overlap=True)
        elif name == "torch_save_rank0":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
            msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if dist.get_rank() == 0:
                os.makedirs(path, exist_ok=True)
                with open(os.path.join(path, "state.pt"), "wb") as f:
                    torch.save({"model": msd, "optim": osd}, f)
                    f.flush()
                    os.fsync(f.fileno())
            dist.barrier()
        elif name in ("dcp_save", "dcp_async_save"):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import DefaultSavePlanner
            from torch.distributed.checkpoint.state_dict import get_state_dict
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            if name == "dcp_save":
                dcp.save(sd, checkpoint_id=path)
            else:
                if self.dcp_planner is None:
                    self.dcp_planner = DefaultSavePlanner(enable_plan_caching=True)
                return dcp.async_save(sd, checkpoint_id=path, process_group=self.gloo, planner=self.dcp_planner)
        elif name == "bytecheckpoint":
            return self.bcp.save(path, model, opt, async_=True)
        return None

    @staticmethod
    def finish(pending) -> None:
        """Block until a started save is durable."""
        if pending is None:
            return
        if hasattr(pending, "wait") and hasattr(pending, "wait_snapshot"):
            pending.wait()
        elif hasattr(pending, "result"):
            pending.result()
        elif hasattr(pending, "upload_completion"):
            pending.upload_completion.result()
        elif callable(pending):
            pending()

    @staticmethod
    def before_step(pending) -> None:
        """What a training loop must call before its next optimizer step."""
        if pending is not None and hasattr(pending, "wait_snapshot"):
            pending.wait_snapshot()

    def load(self, name: str, path: str, model, opt) -> None:
        distributed = dist.is_initialized()
        if name.startswith("ours"):
            (self.ckpt or self.cp).load(path, {"model": model, "optim": opt})
        elif name == "torch_save_rank0":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                                 set_optimizer_state_dict)
            rank0 = not distributed or dist.get_rank() == 0
            full = torch.load(os.path.join(path, "state.pt"), weights_only=True) if rank0 else {"model": {}, "optim": {}}
            # Separate calls: set_state_dict treats a non-zero rank's empty model dict as "optimizer
            # only" and skips the model broadcast rank 0 then waits in.
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed)
            set_model_state_dict(model, full["model"], options=options)
            set_optimizer_state_dict(model, opt, full["optim"], options=options)
        elif name.startswith("dcp"):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=path, no_dist=not distributed)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        elif name == "bytecheckpoint":
            self.bcp.load(path, model, opt)


# ------------------------------------------------------------------ machine limits


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class Limits:
    """The machine's limits for this rank's `nbytes`, in the checkpoint's directory. The buffers are
    allocated and touched once: sampling allocates nothing (freeing a GiB just before a save
    slowed that save here), and the speeds drift by up to 2x within minutes, so they are sampled
    around the saves and loads they bound and their medians reported."""

    def __init__(self, root: str, nbytes: int):
        self.path = os.path.join(root, f"limit_{dist.get_rank() if dist.is_initialized() else 'single'}.bin")
        self.src = torch.randn(nbytes // 4)
        self.dst = torch.zeros_like(self.src)
        self.dst.copy_(self.src)
        raw = torch.empty(nbytes + 8192, dtype=torch.uint8)
        off = (-raw.data_ptr()) % 4096
        self.aligned = memoryview(raw[off:off + nbytes // 4096 * 4096].fill_(7).numpy())  # keeps raw alive

    def memcpy(self) -> float:
        """The copy limit: the best of `copy_` and the streaming copy the snapshot uses
        (`hostmem.stream_copy`), into already-touched memory (every rank at once)."""
        from ckpt_plugins._src import hostmem
        barrier()
        t = time.perf_counter()
        self.dst.copy_(self.src)
        plain = time.perf_counter() - t
        barrier()
        t = time.perf_counter()
        hostmem.stream_copy(self.dst.data_ptr(), self.src.data_ptr(), self.src.numel() * 4)
        return min(plain, time.perf_counter() - t)

    def first_touch(self, nbytes: int) -> float:
        """Faulting in `nbytes` of fresh memory (every rank at once): what a load into a freshly
        built model pays to create optimizer state the model does not have yet."""
        barrier()
        t = time.perf_counter()
        torch.empty(nbytes, dtype=torch.uint8).zero_()
        return time.perf_counter() - t

    def write(self) -> float:
        """Sequential O_DIRECT write + fsync, 8 MiB per call (the file stays for `read`)."""
        barrier()
        t = time.perf_counter()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        for i in range(0, len(self.aligned), 8 << 20):
            os.write(fd, self.aligned[i:i + (8 << 20)])
        os.fsync(fd)
        os.close(fd)
        return time.perf_counter() - t

    def read(self) -> tuple:
        """Cold reads of `write`'s file into touched memory: the way the loader reads (its read
        threads at once, its piece size, O_DIRECT), then one sequential reader through the page
        cache, evicted first (how torch.load, DCP and most tools read). Returns both."""
        import inspect
        from concurrent.futures import ThreadPoolExecutor
        import ckpt_plugins as cp
        from ckpt_plugins._src.engine.exchange import READ_PIECE
        threads = inspect.signature(cp.Checkpointer).parameters["read_threads"].default
        pieces = range(0, len(self.aligned), READ_PIECE)
        times = []
        drop_cache(self.path)
        barrier()
        t = time.perf_counter()
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda i: os.preadv(fd, [self.aligned[i:i + READ_PIECE]], i), pieces))
        os.close(fd)
        times.append(time.perf_counter() - t)
        drop_cache(self.path)
        barrier()
        t = time.perf_counter()
        fd = os.open(self.path, os.O_RDONLY)
        for i in range(0, len(self.aligned), 8 << 20):
            os.preadv(fd, [self.aligned[i:i + (8 << 20)]], i)
        os.close(fd)
        times.append(time.perf_counter() - t)
        os.remove(self.path)
        return tuple(times)


# ------------------------------------------------------------------ the 2-rank run


def cold_model(layers: int, dim: int, path: str, rank: int) -> tuple:
    """A freshly built model (FSDP2, sharding `dim`) and optimizer to load `path` into, with the
    checkpoint's pages dropped from the cache once every rank is ready."""
    fresh, fresh_opt = build(layers, fsdp=True, dim=dim)
    dist.barrier()
    if rank == 0:
        drop_cache(path)
    dist.barrier()
    return fresh, fresh_opt


def resident() -> int:
    """This process's resident memory now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """Start a new peak: VmHWM restarts from the resident memory now (Linux clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak() -> int:
    """This process's peak resident memory since the last reset_peak, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def timed_save(methods: Methods, name: str, path: str, model, opt) -> tuple:
    """(stall, time to commit) of one save, started together on every rank."""
    dist.barrier()
    t0 = time.perf_counter()
    pending = methods.save(name, path, model, opt)
    stall = time.perf_counter() - t0
    methods.before_step(pending)
    methods.finish(pending)
    return stall, time.perf_counter() - t0


def worker(rank: int, world: int, port: int, args, root: str, out_path: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    layers = args.layers
    model, opt = build(layers, fsdp=True)
    train_step(model, opt, 0)
    methods = Methods(world, args.methods)
    reference = local_state(model, opt)
    rank_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    opt_bytes = sum(t.numel() * t.element_size() for k, t in reference.items() if k.startswith("o/"))
    results = {"rank_bytes": rank_bytes, "opt_bytes": opt_bytes,
               "limits": {"memcpy": [], "write": [], "read": [], "read_cached": [], "first_touch": []},
               "methods": {}, "verify": {"load": [], "cols": [], "load_plain": [], "cols_plain": [], "load_phase": [],
                          "cols_phase": []}}
    if rank == 0 and methods.bcp is None:
        results["bytecheckpoint_error"] = methods.bcp_error

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    available = [m for m in METHODS if methods.available(m)]
    # The table is the steady state: ours warmed up as the framework hooks do after the first
    # step, and every method's first save made (unmeasured) before the repetitions. First saves
    # are measured apart, each in a fresh process tree (first_saves).
    methods.ckpt.warm_up({"model": model, "optim": opt})
    for name in available:
        methods.finish(methods.save(name, os.path.join(root, f"unmeasured_{name}"), model, opt))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(root, f"unmeasured_{name}"), ignore_errors=True)
        release_memory()
    limits = Limits(root, rank_bytes)
    for rep in range(args.reps):
        results["limits"]["write"].append(slowest(limits.write()))
        # Saves first, every method in turn; then the loads, so no load reads a file its save wrote
        # an instant before (this disk reads fresh data slower), in an order that rotates each rep.
        for name in available:
            res = results["methods"].setdefault(name, {"stall": [], "commit": [], "load": [], "cols": [],
                                                      "loop": [], "bytes": 0, "ok": True})
            path = os.path.join(root, f"{name}_{rep}")
            results["limits"]["memcpy"].append(slowest(limits.memcpy()))
            stall, commit = timed_save(methods, name, path, model, opt)
            res["stall"].append(slowest(stall))
            res["commit"].append(slowest(commit))
            if rank == 0:
                res["bytes"] = dir_bytes(path)
            release_memory()
        results["limits"]["write"].append(slowest(limits.write()))
        direct, cached = limits.read()
        results["limits"]["read"].append(slowest(direct))
        results["limits"]["read_cached"].append(slowest(cached))
        results["limits"]["first_touch"].append(slowest(limits.first_touch(opt_bytes)))
        release_memory()
        for name in (available[rep % len(available):] + available[:rep % len(available)]) * args.load_rounds:
            res = results["methods"][name]
            path = os.path.join(root, f"{name}_{rep}")
            # the same layout, then another one at the same world size: FSDP2 sharding every
            # tensor's columns (Shard(1)) instead of its rows, so each rank needs part of every file
            for column, dim in (("load", 0), ("cols", 1)):
                fresh, fresh_opt = cold_model(layers, dim, path, rank)
                t0 = time.perf_counter()
                methods.load(name, path, fresh, fresh_opt)
                res[column].append(slowest(time.perf_counter() - t0))
                # compared as row shards (redistributed: no second reference held in memory)
                got = local_state(fresh, fresh_opt, dim=0 if dim else None)
                res["ok"] &= bool(slowest(0.0 if same(got, reference) else 1.0) == 0.0)
                del fresh, fresh_opt, got
                release_memory()
                if name == "ours_sync":  # the same load verified (one load path serves all of ours)
                    fresh, fresh_opt = cold_model(layers, dim, path, rank)
                    t0 = time.perf_counter()
                    loaded = methods.ckpt.load(path, {"model": fresh, "optim": fresh_opt}, verify=True)
                    results["verify"][column].append(slowest(time.perf_counter() - t0))
                    results["verify"][column + "_plain"].append(res[column][-1])
                    results["verify"][column + "_phase"].append(slowest(loaded.telemetry.seconds("verify")))
                    del fresh, fresh_opt, loaded
                    release_memory()
            dist.barrier()
        for name in available:
            keep = rep == args.reps - 1  # the last checkpoint of each method is loaded 2 -> 1 by the parent
            if rank == 0 and not keep:
                shutil.rmtree(os.path.join(root, f"{name}_{rep}"), ignore_errors=True)
        # Training-loop overhead: each method's loop right after the same loop without saves. A
        # save every k steps, never after the last step; the clock stops when the last step ends,
        # so what a method delays (blocking, waiting for its snapshot or for the previous commit)
        # is charged, and its last save's background writes are not.
        for name in [m for m in METHODS if methods.available(m)]:
            elapsed = {}
            for run in (None, name):
                dist.barrier()
                t0 = time.perf_counter()
                pending = None
                for step in range(1, args.steps + 1):
                    methods.before_step(pending)
                    train_step(model, opt, 1000 + step)
                    if run is not None and step % args.every == 0 and step < args.steps:
                        methods.finish(pending)  # a save waits for the previous one's commit
                        pending = methods.save(name, os.path.join(root, f"loop_{name}_{step}"), model, opt)
                methods.before_step(pending)
                elapsed[run] = slowest(time.perf_counter() - t0)
                methods.finish(pending)
            results["methods"][name]["loop"].append(elapsed[name] - elapsed[None])
            release_memory()
            dist.barrier()
            if rank == 0:
                for step in range(args.every, args.steps, args.every):
                    shutil.rmtree(os.path.join(root, f"loop_{name}_{step}"), ignore_errors=True)
        # the loops trained the model: reset to the reference state for the next repetition
        del model, opt
        release_memory()
        model, opt = build(layers, fsdp=True)
        train_step(model, opt, 0)
    full = full_reference(model, opt)  # collective: every rank takes part
    if rank == 0:
        torch.save(full, os.path.join(root, "reference.pt"))
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    if methods.ckpt is not None:
        methods.ckpt.close()
    dist.destroy_process_group()


def first_save_worker(rank: int, world: int, port: int, args, name: str, warm: bool, out_path: str) -> None:
    """One method's first save in a fresh process tree: build, one training step, (ours, `warm`:
    the warm-up the framework hooks run after the first step), two more steps, then the save."""
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, opt = build(args.layers, fsdp=True)
    train_step(model, opt, 0)
    baseline = resident()  # training's own memory: the model, its gradients and optimizer state
    methods = Methods(world, [name])
    if not methods.available(name):
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"error": methods.bcp_error}, f)
        dist.destroy_process_group()
        return
    if warm:
        methods.ckpt.warm_up({"model": model, "optim": opt})
    dist.barrier()
    t0 = time.perf_counter()
    for step in (1, 2):
        train_step(model, opt, step)
    steps = time.perf_counter() - t0
    path = os.path.join(args.root, f"first_{name}")
    reset_peak()
    stall, commit = timed_save(methods, name, path, model, opt)
    # what the method holds beyond training's memory at its peak: its staging (a warm-up's
    # included), buffers and threads, from the save call until the checkpoint is durable
    memory = peak() - baseline
    out = [max(v, 0.0) for v in (stall, commit, steps)] + [float(memory)]
    t = torch.tensor(out, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(zip(("stall", "commit", "steps", "memory"), t.tolist())), f)
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    if methods.ckpt is not None:
        methods.ckpt.close()
    dist.destroy_process_group()


def first_saves(args, root: str, methods: list) -> dict:
    """Every method's first save, each in its own fresh process tree; ours also without the warm-up."""
    out = {}
    for name in methods:
        for warm in ((True, False) if name.startswith("ours") else (False,)):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            path = os.path.join(root, "first.json")
            mp.spawn(first_save_worker, args=(2, port, args, name, warm, path), nprocs=2, join=True)
            with open(path) as f:
                out[name + ("" if warm or not name.startswith("ours") else " (no warm-up)")] = json.load(f)
    return out


def full_reference(model, opt):
    named = dict(model.named_parameters())
    out = {f"p/{n}": p.full_tensor() for n, p in named.items()}
    for n, p in named.items():
        for k, v in opt.state[p].items():
            out[f"o/{n}/{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


# ------------------------------------------------------------------ 2 -> 1 in the parent


def resharded_loads(args, root: str, methods_run) -> dict:
    """Load each method's last checkpoint into one plain process (2 ranks -> 1), repetition by
    repetition, each repetition after its own measurement of one process's cold read limit (this
    disk's speed drifts by 2x within minutes: a limit measured once would be a different disk)."""
    reference = torch.load(os.path.join(root, "reference.pt"))
    methods = Methods(1, args.methods)
    total = sum(t.numel() * t.element_size() for t in reference.values())
    opt_bytes = sum(t.numel() * t.element_size() for k, t in reference.items() if k.startswith("o/"))
    out = {"_read_limit": [], "_read_cached": [], "_touch": [],
           **{name: {"load": [], "ok": True} for name in methods_run}}
    limits = Limits(root, total)
    for rep in range(args.reps):
        limits.write()
        direct, cached = limits.read()  # one process reading every rank's bytes
        out["_read_limit"].append(direct)
        out["_read_cached"].append(cached)
        out["_touch"].append(limits.first_touch(opt_bytes))
        release_memory()
        for name in methods_run:
            if "error" in out[name]:
                continue
            path = os.path.join(root, f"{name}_{args.reps - 1}")
            drop_cache(path)
            model, opt = build(args.layers, fsdp=False)
            t0 = time.perf_counter()
            try:
                methods.load(name, path, model, opt)
            except Exception as exc:
                out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                continue
            out[name]["load"].append(time.perf_counter() - t0)
            got = {f"p/{n}": p.detach() for n, p in model.named_parameters()}
            for n, p in model.named_parameters():
                got.update({f"o/{n}/{k}": v for k, v in opt.state[p].items()})
            out[name]["ok"] &= same(got, reference)
            del model, opt
    del limits
    for name in methods_run:
        shutil.rmtree(os.path.join(root, f"{name}_{args.reps - 1}"), ignore_errors=True)
    out["_touch"] = statistics.median(out["_touch"])
    out["_read_limit"] = statistics.median(out["_read_limit"])
    out["_read_cached"] = statistics.median(out["_read_cached"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params-m", type=float, default=96, help="model parameters, millions (x12 bytes with AdamW)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--load-rounds", type=int, default=2,
                        help="loads of each repetition's checkpoints (same layout and cols, back to back)")
    parser.add_argument("--steps", type=int, default=7, help="training steps per loop")
    parser.add_argument("--every", type=int, default=2, help="save every k steps in the loop")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--methods", type=lambda text: text.split(","), default=None,
                        help=f"a comma-separated subset of {','.join(METHODS)} (default: all)")
    args = parser.parse_args()
    args.layers = max(1, round(args.params_m * 1e6 / WIDTH ** 2))
    root = tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir)
    out_path = os.path.join(root, "results.json")
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args.root = root
        firsts = first_saves(args, root, [m for m in METHODS if Methods.wanted(m, args.methods)])
        mp.spawn(worker, args=(2, port, args, root, out_path), nprocs=2, join=True)
        with open(out_path) as f:
            results = json.load(f)
        resharded = resharded_loads(args, root, list(results["methods"]))
        report(args, results, resharded, firsts)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(args, results, resharded, firsts) -> None:
    med = statistics.median
    rank_bytes = results["rank_bytes"]
    total = 2 * rank_bytes
    lim = {k: med(v) for k, v in results["limits"].items()}
    print(f"\nFSDP2, 2 processes (gloo, CPU), {args.layers} x Linear({WIDTH},{WIDTH}) + AdamW: "
          f"{total / 2**30:.2f} GiB of state ({rank_bytes / 2**20:.0f} MiB per rank); medians of {args.reps}")
    print(f"machine limits for one rank's bytes: copy {lim['memcpy']:.3f} s (best of copy_ and the streaming "
          f"copy, {rank_bytes / lim['memcpy'] / 1e9:.1f} GB/s), O_DIRECT write {lim['write']:.3f} s "
          f"({total / lim['write'] / 1e9:.2f} GB/s both ranks), cold read the loader's way (its threads, "
          f"piece size, O_DIRECT) {lim['read']:.3f} s ({total / lim['read'] / 1e9:.2f} GB/s both ranks; one "
          f"reader through the page cache {lim['read_cached']:.3f} s); one process's cold read of all "
          f"{resharded['_read_limit']:.3f} s ({total / resharded['_read_limit'] / 1e9:.2f} GB/s; through the "
          f"page cache {resharded['_read_cached']:.3f} s)")
    touch = lim["first_touch"]
    print(f"first touch of a fresh model's optimizer state ({results['opt_bytes'] / 2**20:.0f} MiB per rank, "
          f"created by every load into a freshly built model): {touch:.3f} s; the loads' limit with it: "
          f"{lim['read'] + touch:.3f} s (same layout, cols); one process's first touch of all "
          f"{resharded['_touch']:.3f} s (2->1 limit {resharded['_read_limit'] + resharded['_touch']:.3f} s)")
    if firsts:
        print("\nfirst saves, each in a fresh process tree (stall and commit, and / the steady-state medians "
              "below; steps: the two training steps before the save, beside ours' warm-up; memory: the largest "
              "rank's peak resident memory from the save call to its commit, above its memory after the first "
              "training step, and / the rank's checkpoint bytes)")
        for name, r in firsts.items():
            base = name.split(" ")[0]
            steady = results["methods"].get(base)
            if "error" in r or steady is None:
                print(f"  {name:<28} not measured ({r.get('error', 'no steady state')})")
                continue
            print(f"  {name:<28} stall {r['stall']:.3f} s ({r['stall'] / med(steady['stall']):.2f}x), commit "
                  f"{r['commit']:.3f} s ({r['commit'] / med(steady['commit']):.2f}x), steps {r['steps']:.3f} s, "
                  f"memory +{r['memory'] / 2**20:.0f} MiB ({r['memory'] / rank_bytes:.2f}x)")
    if "bytecheckpoint_error" in results:
        print(f"bytecheckpoint: not measured ({results['bytecheckpoint_error']})")
    rows = {}
    for name, r in results["methods"].items():
        rows[name] = {"stall": med(r["stall"]), "loop": med(r["loop"]), "commit": med(r["commit"]),
                      "load": med(r["load"]), "cols": med(r["cols"]), "reshard": med(resharded[name]["load"]) if "load" in resharded.get(name, {}) else math.nan,
                      "ok": r["ok"] and resharded.get(name, {}).get("ok", False), "bytes": r["bytes"],
                      "memory": (firsts or {}).get(name, {}).get("memory", math.nan)}
    peers = [p for p in PEERS if p in rows]
    columns = ("stall", "loop", "commit", "load", "cols", "reshard")
    best = {k: min(rows[p][k] for p in peers) if peers else math.nan for k in columns}
    limit = {"stall": lim["memcpy"], "commit": lim["write"], "load": lim["read"] + touch,
             "cols": lim["read"] + touch,
             "reshard": resharded["_read_limit"] + resharded["_touch"], "loop": math.nan}
    cached = {"load": lim["read_cached"], "cols": lim["read_cached"], "reshard": resharded["_read_cached"]}
    print(f"\n{'method':<17}{'stall s':>9}{'loop +s':>9}{'commit s':>10}{'load s':>9}{'cols s':>9}{'2->1 s':>9}"
          f"{'GiB':>6}{'+MiB':>7}  bit-exact   (+MiB: peak host memory per rank above training's, first saves)")
    for name, r in rows.items():
        print(f"{name:<17}{r['stall']:>9.3f}{r['loop']:>9.3f}{r['commit']:>10.3f}{r['load']:>9.3f}{r['cols']:>9.3f}"
              f"{r['reshard']:>9.3f}{r['bytes'] / 2**30:>6.2f}{r['memory'] / 2**20:>7.0f}  {'yes' if r['ok'] else 'NO'}")
        if name in resharded and "error" in resharded[name]:
            print(f"{'':<17}2->1 load failed: {resharded[name]['error']}")
    print("\nratios: ours / best peer, and ours / machine limit (stall vs copy, commit vs O_DIRECT write, "
          "loads vs the loader-way cold read plus first touch, 2->1 vs one process's cold read; and loads vs "
          "one reader through the page cache)")
    for name in ("ours_sync", "ours_async", "ours_overlap"):
        r = rows.get(name)
        if r is None:
            continue
        parts = []
        for k in columns:
            vs_limit = f" / limit {r[k] / limit[k]:.2f}" if not math.isnan(limit[k]) else ""
            if k in cached:
                vs_limit += f" (page cache {r[k] / cached[k]:.2f})"
            parts.append(f"{k} {r[k] / best[k]:.2f}{vs_limit}" if best[k] > 0 else f"{k} n/a{vs_limit}")
        print(f"  {name:<14} " + ", ".join(parts))
    v = results["verify"]
    if v["load"]:
        print("\nverify=True (ours_sync's checkpoints, each load beside its plain twin): " + "; ".join(
            f"{what} {med(v[c]):.3f} s vs {med(v[c + '_plain']):.3f} s plain, its verify phases "
            f"{med(v[c + '_phase']):.3f} s = {med(v[c + '_phase']) / med(v[c + '_plain']):.1%} of the plain load"
            for c, what in (("load", "same-layout load"), ("cols", "cols load"))))
    ours = [r for name, r in results["methods"].items() if name.startswith("ours")]
    paired = [c / l for r in ours for l, c in zip(r["load"], r["cols"])]
    print("\nresharded load / same-layout load: " + ", ".join(
        f"{name} cols {rows[name]['cols'] / rows[name]['load']:.2f}" for name in rows if name.startswith("ours"))
        + f"; all {len(paired)} of ours (one load path, whatever the save): median of the ratios of loads "
          f"taken back to back {med(paired):.2f}, ratio of the medians "
          f"{med([c for r in ours for c in r['cols']]) / med([l for r in ours for l in r['load']]):.2f}")
    if peers:
        print("best peer per column: " + ", ".join(f"{k} {min(peers, key=lambda p: rows[p][k])}" for k in columns))


if __name__ == "__main__":
    main()
