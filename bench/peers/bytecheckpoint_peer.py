"""ByteCheckpoint (PyPI `bytecheckpoint==0.0.2`) as a peer in the save/load benchmark.

Workload: an FSDP2 (`torch.distributed.fsdp.fully_shard`) model + a torch AdamW optimizer, gloo, CPU,
torch 2.13. The package is used as released, through its public API
`bytecheckpoint.save(path, {"model": m, "optimizer": o}, framework="fsdp2", fast_saving=...)` and
`bytecheckpoint.load(path, {"model": m, "optimizer": o}, framework="fsdp2")`; nothing of it is
copied here, a few things are patched at runtime by `apply_patches()` (see each comment there).

Install (torch stays pinned):
    .venv/bin/pip install --no-deps -c constraints.txt bytecheckpoint==0.0.2
    .venv/bin/pip install -c constraints.txt grpcio==1.69.0 protobuf==3.20.3

Self-test (2 gloo processes, a tiny model, a temporary directory that is deleted at the end):
    .venv/bin/python bench/peers/bytecheckpoint_peer.py
"""
from __future__ import annotations

import logging
import os

FRAMEWORK = "fsdp2"
_patched = False
_plan_cache = False
_step = 0  # bytecheckpoint's per-save `global_steps`; every rank calls save() the same number of times


# ------------------------------------------------------------------ patches


def _quiet_log(user_level=None) -> None:
    log = logging.getLogger("bytecheckpoint")
    log.setLevel((user_level or "WARNING").upper())
    # Every load of a {model, optimizer} pair warns "Key extra_state not found"; we never save one.
    log.addFilter(lambda r: "Key extra_state not found" not in r.getMessage())


async def _async_serve_loopback(servicer, async_addr):
    """server_lib.async_serve, bound to 127.0.0.1 and announcing 127.0.0.1 (runs in the server process)."""
    import grpc
    from bytecheckpoint.utilities.server import report_service_pb2_grpc, server_lib

    server = grpc.aio.server(options=server_lib._GRPC_OPTIONS)
    report_service_pb2_grpc.add_ByteCheckpointReportServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async_addr.obj = f"127.0.0.1:{port}"
    async_addr.e.set()
    await server.wait_for_termination()


def _serve_in_loop_loopback(world_size, conn):
    """Entry point of bytecheckpoint's gRPC coordinator process, with the loopback-only server."""
    user_level = os.environ.get("BYTECHECKPOINT_LOGGING_LEVEL")
    os.environ["BYTECHECKPOINT_LOGGING_LEVEL"] = user_level or "ERROR"
    from bytecheckpoint.utilities.server import server_lib

    _quiet_log(user_level)
    server_lib.async_serve = _async_serve_loopback
    server_lib._get_local_ip = lambda: "127.0.0.1"
    server_lib._serve_in_loop(world_size, conn)


def _start_server_in_new_process_loopback(world_size: int) -> str:
    """server_lib.start_server_in_new_process with _serve_in_loop_loopback as the child's target."""
    import multiprocessing

    parent_conn, child_conn = multiprocessing.Pipe()
    p = multiprocessing.get_context("spawn").Process(
        target=_serve_in_loop_loopback, args=(world_size, child_conn), daemon=True)
    p.start()
    return parent_conn.recv()


def apply_patches(plan_cache: bool = False) -> None:
    """Make bytecheckpoint 0.0.2 run here (torch 2.13, CPU, gloo, FSDP2, 127.0.0.1 only). Idempotent.

    plan_cache=True also applies the two fixes that let `fast_saving=True` be asynchronous for
    FSDP2 from the second save of the same model on (see _enable_plan_cache); without them, a
    "fast" save writes and fsyncs every data file before it returns, exactly like a blocking one.
    """
    global _patched, _plan_cache
    if not _patched:
        # Not patches, logging only: its INFO log prints ~60 lines per save/load per rank, and its
        # import warns that a CPU-only torch has no cudart. Keep its later warnings and errors.
        user_level = os.environ.get("BYTECHECKPOINT_LOGGING_LEVEL")
        os.environ["BYTECHECKPOINT_LOGGING_LEVEL"] = user_level or "ERROR"
        try:
            import bytecheckpoint  # noqa: F401  (imports grpc + protobuf: rpc_context -> server_lib)
        finally:
            if user_level is None:
                del os.environ["BYTECHECKPOINT_LOGGING_LEVEL"]
        _quiet_log(user_level)
        from bytecheckpoint.utilities.server import server_lib

        # Its gRPC coordinator finds "its" IP by connect()ing a UDP socket to 8.8.8.8 and listens on
        # [::] (all interfaces); here only 127.0.0.1 may be used, and the ranks share one host.
        server_lib._get_local_ip = lambda: "127.0.0.1"
        # ... and that happens in a fresh spawned process that would not see the line above, so the
        # process is started with a target that binds to and announces 127.0.0.1 only.
        server_lib.start_server_in_new_process = _start_server_in_new_process_loopback
        _patched = True
    if plan_cache and not _plan_cache:
        _enable_plan_cache()
        _plan_cache = True


def _enable_plan_cache() -> None:
    """Two fixes to bytecheckpoint's own save path so that its plan/metadata cache can ever hit.

    Without them every FSDP2 save misses the cache, and the miss path runs the data write inside
    its all-reduce with async_io=False: `fast_saving=True` then only defers a gRPC barrier.
    """
    from pathlib import Path

    from bytecheckpoint.checkpointer import base_checkpointer
    from bytecheckpoint.planner.fsdp.fsdp_planner import FSDPSavePlanner

    original = base_checkpointer.save_state_dict
    if getattr(original, "_peer_patched", False):
        return

    def save_state_dict(*, state_dict, state_path, planner, **kwargs):
        # save_state_dict() looks the cache up before set_up_planner(), and a fresh planner has no
        # state_dict yet, so FSDPSavePlanner.lookup_plan_meta() always returns None: set it up first
        # (set_up_planner() is run again inside; it only re-flattens the same dict).
        if isinstance(planner, FSDPSavePlanner):
            planner.set_up_planner(state_dict, False)
        # On a cache hit it writes `state_path / ".metadata.tmp"`, but the FSDP2 checkpointer passes
        # a str (os.path.join): pass a pathlib.Path.
        return original(state_dict=state_dict, state_path=Path(state_path), planner=planner, **kwargs)

    save_state_dict._peer_patched = True
    base_checkpointer.save_state_dict = save_state_dict


# ------------------------------------------------------------------ the peer's API


class _PendingSave:
    """What save(..., async_=True) returns: result() blocks until this rank's part is durable."""

    def __init__(self, keys):
        self._keys = keys

    def result(self, timeout=None):
        from bytecheckpoint.storage._storage import _local_storage_writer
        from bytecheckpoint.storage._storage import base_storage

        # Each saved component (model, optimizer) has one background thread and a 1-slot queue in
        # bytecheckpoint; its job waits for the data-file futures, then all ranks meet in the gRPC
        # barrier and rank 0 writes the tracker file. Joining both queues waits for all of that.
        for key in self._keys:
            queue = _local_storage_writer.get_sync_queue(key, FRAMEWORK, "")
            if not queue.join(timeout=timeout):
                raise TimeoutError(f"bytecheckpoint {key} save still running after {timeout} s")
        if base_storage._process_should_exit.is_set():
            raise RuntimeError("bytecheckpoint background save failed (see its error log)")


def save(path: str, model, optimizer, async_: bool = False):
    """Save model + optimizer under `path` (a directory). Returns a _PendingSave if async_, else None.

    The synchronous form returns after every rank's files and the metadata are written and the
    ranks have met in bytecheckpoint's gRPC barrier (and rank 0 has written its tracker file).
    """
    global _step
    apply_patches()
    import bytecheckpoint

    _step += 1
    bytecheckpoint.save(
        path,
        {"model": model, "optimizer": optimizer},
        framework=FRAMEWORK,
        fast_saving=async_,
        # A global step makes it run its full commit protocol (failure gather over gRPC + tracker
        # file); without one it skips both and silently drops write errors. Not appended to path.
        global_steps=_step,
        ignore_append_global_steps_to_folder=True,
    )
    return _PendingSave(("model", "optimizer")) if async_ else None


def load(path: str, model, optimizer) -> None:
    """Load model + optimizer saved by save() in place: FSDP2 (any world size) or, outside any
    process group, a plain nn.Module (2 -> 1 reshard); bytecheckpoint needs a process group even
    then, so a 1-rank gloo group on an in-memory store (no sockets) is made for the call."""
    apply_patches()
    import bytecheckpoint
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        bytecheckpoint.load(path, {"model": model, "optimizer": optimizer}, framework=FRAMEWORK)
    finally:
        if own_group:
            dist.destroy_process_group()


# ------------------------------------------------------------------ self-test


def _build(seed_model: bool = True):
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0 if seed_model else 1)
    model = nn.Sequential(nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8, bias=False))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train_step(model, opt, step: int) -> None:
    import torch

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _snapshot(model, opt):
    """Every parameter and optimizer state, as full (unsharded) tensors, by name."""
    out = {}
    for name, p in model.named_parameters():
        out[f"param/{name}"] = _full(p.detach()).clone()
        for k, v in opt.state[p].items():
            out[f"optim/{name}/{k}"] = _full(v).clone() if hasattr(v, "clone") else v
    return out


def _bit_equal(a, b):
    import torch

    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            ok = x == y
        else:
            ok = x.dtype == y.dtype and x.shape == y.shape and torch.equal(
                x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        if not ok:
            bad.append(k)
    return bad


def _selftest_worker(rank: int, world: int, port: int, root: str, plan_cache: bool) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        apply_patches(plan_cache=plan_cache)
        model, opt = _build()
        _train_step(model, opt, 0)
        cases = []
        # 1: blocking save. 2: async save, then one more training step that must not leak into it.
        # 3: async save again (with plan_cache=True this is the one that hits the cache).
        for i, async_ in enumerate((False, True, True)):
            path = os.path.join(root, f"ckpt{i}")
            expect = _snapshot(model, opt)
            pending = save(path, model, opt, async_=async_)
            if pending is not None:
                _train_step(model, opt, 100 + i)  # overlaps the background part of the save
                pending.result(timeout=120)
            dist.barrier()
            fresh, fresh_opt = _build(seed_model=False)
            load(path, fresh, fresh_opt)
            bad = _bit_equal(expect, _snapshot(fresh, fresh_opt))
            cases.append((f"save#{i + 1} {'async' if async_ else 'sync '}", len(expect), bad))
            if rank == 0:  # for the 2 -> 1 load in the parent
                import torch
                torch.save(expect, os.path.join(root, f"expect{i}.pt"))
            # The loaded pair must also keep training identically to the original.
            if i == 0:
                _train_step(fresh, fresh_opt, 7)
                ref, ref_opt = _build()
                _train_step(ref, ref_opt, 0)
                _train_step(ref, ref_opt, 7)
                bad2 = _bit_equal(_snapshot(ref, ref_opt), _snapshot(fresh, fresh_opt))
                cases.append(("  +1 step after load", len(expect), bad2))
        if rank == 0:
            for name, n, bad in cases:
                print(f"[rank 0] {name}: {n} tensors, " + ("bit-identical" if not bad else f"MISMATCH {bad}"))
            print(f"[rank 0] files: {sorted(os.listdir(os.path.join(root, 'ckpt0')))} + "
                  f"{sorted(os.listdir(os.path.join(root, 'ckpt0', 'model')))}")
        if any(bad for _, _, bad in cases):
            raise SystemExit(f"rank {rank}: mismatch")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _main() -> None:
    import argparse
    import shutil
    import socket
    import tempfile

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser()
    parser.add_argument("--plan-cache", action="store_true", help="apply_patches(plan_cache=True)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = tempfile.mkdtemp(prefix="bcp_peer_")
    try:
        mp.spawn(_selftest_worker, args=(2, port, root, args.plan_cache), nprocs=2)
        # 2 -> 1: every checkpoint into a plain (unsharded) model + AdamW, in this process.
        import torch
        from torch import nn

        for i in range(3):
            torch.manual_seed(1)
            model = nn.Sequential(nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8, bias=False))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            load(os.path.join(root, f"ckpt{i}"), model, opt)
            expect = torch.load(os.path.join(root, f"expect{i}.pt"))
            bad = _bit_equal(expect, _snapshot(model, opt))
            print(f"[parent] save#{i + 1} loaded 2 -> 1 into a plain model: {len(expect)} tensors, "
                  + ("bit-identical" if not bad else f"MISMATCH {bad}"))
            if bad:
                raise SystemExit("2 -> 1 mismatch")
        print("bytecheckpoint peer self-test: OK")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    _main()
