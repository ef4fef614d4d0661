"""Run a function on N real processes joined by a gloo group on 127.0.0.1."""
from __future__ import annotations

import atexit
import faulthandler
import os
import socket
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks fork from one server process that imported these once: a spawned rank spent 4-10 s of
# CPU importing them before its test began. Megatron is left out: its CPU shim patches torch.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "torch._inductor.compile_fx",
           "ckpt_plugins", "transformers.models.llama.modeling_llama", "transformers.models.qwen3_moe.modeling_qwen3_moe",
           "transformers.trainer"]


def _start_method() -> str:
    # CUDA cannot be used in a process forked from one whose imports may have touched it: with a
    # GPU, ranks are spawned
    import torch
    return "spawn" if torch.cuda.is_available() else "forkserver"


def rank_context():
    """The multiprocessing context every test rank starts from (forked from the preloaded server)."""
    ctx = mp.get_context(_start_method())
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts, on first use
    return ctx


def _start(worker, world_size: int, *args) -> None:
    """Start `worker(rank, world_size, port, env, *args)` on each rank and wait; any rank's exception
    fails the caller. `env` is the caller's environment now, which a forked rank would not see."""
    mp.start_processes(worker, args=(world_size, free_port(), dict(os.environ)) + args, nprocs=world_size,
                       join=True, start_method=rank_context().get_start_method())


def _as_spawned(env: dict) -> None:
    """Give a forked rank the caller's environment, as a spawned one has (`_exit_as_spawned` gives
    it the exit functions an interpreter's exit runs)."""
    faulthandler.enable()  # a native abort in a rank prints every thread's Python stack
    os.environ.clear()
    os.environ.update(env)


def _exit_as_spawned() -> None:
    atexit._run_exitfuncs()  # a forked rank ends with os._exit, which skips them


def _worker(rank, world_size, port, env, fn, args, backend="gloo"):
    _as_spawned(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    if backend == "nccl":
        import torch
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=120))
    fn(rank, world_size, *args)  # on an error, no orderly teardown: it would wait for the other ranks
    dist.destroy_process_group()
    _exit_as_spawned()


def run_ranks(world_size: int, fn, *args, backend: str = "gloo") -> None:
    """Call fn(rank, world_size, *args) on each rank; any rank's exception fails the caller.
    backend="nccl": rank r on GPU r."""
    _start(_worker, world_size, fn, args, backend)


def _env_worker(rank, world_size, port, env, fn, args):
    """A rank as torchrun starts it: the environment set, no process group yet (the framework
    under test creates it)."""
    _as_spawned(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    fn(rank, world_size, *args)
    if dist.is_initialized():
        dist.destroy_process_group()
    _exit_as_spawned()


def exit_without_teardown() -> None:
    """End a rank now, once every rank got here, without the interpreter's teardown: stock gloo
    runs of the Trainer and of DeepSpeed aborted there now and then ("terminate called without an
    active exception"), in runs without the plugin too, and so did a one-process accelerate run
    (not reproduced in 55 runs here; the likely cause: at teardown Python 3.11 ends a daemon
    thread that is still in native code with pthread_exit, which aborts in a noexcept C++ frame)."""
    import sys
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_env_ranks(world_size: int, fn, *args) -> None:
    """Like run_ranks, for frameworks that initialise torch.distributed themselves from the
    torchrun environment (the HF Trainer, accelerate, DeepSpeed)."""
    _start(_env_worker, world_size, fn, args)


def _lone_worker(rank, world_size, port, env, fn, args):
    """A rank whose failure does not take the others down (run_ranks_until)."""
    _as_spawned(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=120))
    fn(rank, world_size, *args)
    _exit_as_spawned()


def run_ranks_until(world_size: int, deadline: float, fn, *args) -> list:
    """Run fn on each rank, letting each live or die on its own (a killed rank leaves the others
    running); returns every process's exit code once all ended, killing any left at `deadline` s."""
    import time
    ctx, port, env = rank_context(), free_port(), dict(os.environ)
    procs = [ctx.Process(target=_lone_worker, args=(r, world_size, port, env, fn, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    end = time.time() + deadline
    for p in procs:
        p.join(max(0.0, end - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]
