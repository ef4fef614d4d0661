"""Against each framework's own checkpointing, on its own model, through its own save and load calls.

DeepSpeed: an HF Llama under ZeRO-1, 2 and 3 (bf16 weights, fp32 masters, torch AdamW) on 2
processes. The same engine saves and loads both ways: `engine.save_checkpoint` /
`load_checkpoint` with the `"checkpoint": {"backend": "bytecheckpoint"}` entry (ours: sync, and
overlapped with `"overlap": true`), and DeepSpeed's own methods (`type(engine).save_checkpoint`, its
torch.save files, followed by an fsync of every file it wrote, which DeepSpeed itself does not
do: both sides are timed to a durable checkpoint).

Megatron-core: a GPTModel with the distributed optimizer (bf16, fp32 masters) on 2 processes, DP2
and TP2, through `megatron.training.checkpointing.save_checkpoint` / `load_checkpoint` with
`--ckpt-backend bytecheckpoint` (ours: sync, and overlapped with `--ckpt-overlap`) and Megatron's
own torch_dist (sync, and with `--native-async` its `--async-save` through its persistent worker,
finalized as its train loop does); resharded loads DP2 -> DP1. Megatron calls CUDA where a GPU run would: the tests' CPU shim
(`tests/megatron_shim.py`) redirects those calls, here as in the tests, and in `--async-save`'s
worker process through a sitecustomize the bench writes. DeepSpeed needs no shim (its CPU
accelerator), only its shared-memory op left unbuilt.

Measured per method: the stall (how long the save call blocks), the time to a committed durable
checkpoint, same-layout loads (page cache dropped) and resharded loads where the framework can
do one, medians of `--reps`. Every load is checked bit for bit against the state saved (but for
Megatron's own load the Adam step counts, which it leaves as they were on the torch-AdamW path
without TE/Apex, an upstream bug), and every checkpoint is deleted after use. `--tiny` measures
the fixed cost instead: a 0.1M-parameter model, medians of 15 saves and loads (page cache kept).

Run: .venv/bin/python bench/native.py                       (both frameworks, about 20 minutes)
     .venv/bin/python bench/native.py --framework deepspeed --params-m 20 --reps 1   (a smoke run)
     .venv/bin/python bench/native.py --tiny
     .venv/bin/python bench/native.py --tiny --framework deepspeed --world 1   (a single process's fixed cost)
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from memory_tier import free_port, slowest  # noqa: E402  (the bench's own helpers)
from save_load import Limits, drop_cache  # noqa: E402


def start(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def fsync_tree(path: str) -> None:
    """What a durable checkpoint costs a writer that does not fsync: every file, then the directories."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def cold(path: str) -> None:
    if dist.get_rank() == 0:
        drop_cache(path)
    dist.barrier()


def llama_config(params_m: float):
    """An HF Llama config of about `params_m` million parameters (tiny ones keep a few layers)."""
    from transformers import LlamaConfig
    if params_m < 1:
        hidden, layers, vocab = 32, 2, 512
    else:
        hidden, vocab = 1024, 32000
        per_layer = 12 * hidden * hidden  # attention 4 h^2 + SwiGLU MLP 3 * h * 8h/3
        layers = max(1, round((params_m * 1e6 - 2 * vocab * hidden) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                       num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                       num_key_value_heads=max(1, hidden // 64), max_position_embeddings=64)


# ------------------------------------------------------------------ DeepSpeed


def ds_engine(stage: int, params_m: float, overlap: bool):
    import deepspeed_ext
    from transformers import LlamaForCausalLM
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda *a, **k: None  # unused on CPU
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(params_m))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "steps_per_print": 10**9,
              "checkpoint": {"backend": "bytecheckpoint", "overlap": overlap, "warm_up": False}}
    engine, *_ = deepspeed_ext.initialize(model=model, optimizer=opt, config=config)
    return engine


def ds_step(engine, seed: int) -> None:
    ids = torch.randint(0, engine.module.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def ds_local_state(engine) -> dict:
    """This rank's saved state as DeepSpeed holds it: weights (stage 3: the partitions), fp32 master
    partitions, the base optimizer's moments and steps."""
    stage3 = engine.zero_optimization_stage() == 3
    opt = engine.optimizer
    out = {f"w{i}": (p.ds_tensor if stage3 else p).detach().clone() for i, p in enumerate(engine.module.parameters())}
    masters = opt.fp32_partitioned_groups_flat if stage3 else opt.single_partition_of_fp32_groups
    out.update({f"m{i}": t.detach().clone() for i, t in enumerate(masters)})
    for i, s in enumerate(opt.optimizer.state.values()):
        out.update({f"o{i}/{k}": v.detach().clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def read_limit(root: str, nbytes: int) -> float:
    """The machine's cold read speed for loads, in bytes/s over every rank at once: each rank reads
    a file of its own the loader's way (`save_load.Limits`)."""
    from ckpt_plugins._src.engine.exchange import READ_PIECE
    limits = Limits(root, max(READ_PIECE, min(nbytes, 256 << 20)))
    limits.write()
    return len(limits.aligned) * dist.get_world_size() / slowest(limits.read()[0])


class Side:
    """One framework's save and load calls, both ways, on one live job."""

    def __init__(self, native_save, ours_save, native_load, ours_load, step, state, checkpoint, native_async=None):
        self.native_save, self.ours_save, self.native_load, self.ours_load = native_save, ours_save, native_load, ours_load
        self.step, self.state = step, state  # state(): this rank's saved tensors, for the bit-for-bit check
        self.checkpoint = checkpoint  # checkpoint(save_dir): the checkpoint a save into save_dir wrote
        self.native_async = native_async  # native_async(save_dir) -> (stall, commit), where the framework has one


def measure(side: Side, args, root: str, what: str, skip_native=lambda key: False) -> dict:
    """Medians over `args.reps` (after one unmeasured round: plans, staging, files) of: the native
    save (fsynced), ours sync, ours overlapped (stall and commit), and the cold loads of both, in
    alternating order; each load checked against the saved state. Fresh paths each round, as a
    run saves; each deleted after use."""
    import ckpt_plugins as cp
    os.makedirs(root, exist_ok=True)
    rec = {k: [] for k in ("native_save", "ours_sync", "ours_overlap_stall", "ours_overlap_commit",
                            "native_load", "ours_load")}
    saved = side.state()

    def timed(fn) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - t)

    limits = []
    for rep in range(args.reps + 1):
        native_dir, ours_dir, overlap_dir = (os.path.join(root, f"{kind}{rep}") for kind in ("native", "ours", "overlap"))
        measured = {"native_save": timed(lambda: (side.native_save(native_dir), fsync_tree(native_dir))),
                    "ours_sync": timed(lambda: side.ours_save(ours_dir, False))}
        dist.barrier()
        t0 = time.perf_counter()
        side.ours_save(overlap_dir, True)
        stall = time.perf_counter() - t0
        cp.checkpointer().wait()
        measured.update(ours_overlap_stall=slowest(stall), ours_overlap_commit=slowest(time.perf_counter() - t0))
        if side.native_async is not None:
            async_dir = os.path.join(root, f"async{rep}")
            dist.barrier()
            stall, commit = side.native_async(async_dir)
            measured.update(native_async_stall=slowest(stall), native_async_commit=slowest(commit))
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(async_dir, ignore_errors=True)
        side.step(rep + 1)  # the state moves on: each load must bring the saved one back
        loads = [("native_load", side.native_load, native_dir), ("ours_load", side.ours_load, ours_dir)]
        for name, load, path in loads[::1 if rep % 2 else -1]:
            cold(path)
            measured[name] = timed(lambda: load(path))
            got = side.state()
            bad = [k for k in saved if not (name == "native_load" and skip_native(k))
                   and (k not in got or not torch.equal(saved[k], got[k]))]
            assert not bad, (f"{what} {name}: not the saved state", [(k, saved[k], got.get(k)) for k in bad][:3])
            side.step(100 + rep)
        side.ours_load(ours_dir)  # the saved state again, for the next saves
        stored = cp.read_metadata(side.checkpoint(ours_dir)).total_bytes
        limits.append(read_limit(root, stored // dist.get_world_size()))
        measured["ours_bytes"] = stored
        measured["native_bytes"] = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(native_dir) for f in fs)
        dist.barrier()
        if dist.get_rank() == 0:
            for d in (native_dir, ours_dir, overlap_dir):
                if rep < args.reps or not args.keep_last:
                    shutil.rmtree(d, ignore_errors=True)
        dist.barrier()
        if rep:
            for k, v in measured.items():
                rec.setdefault(k, []).append(v)
    out = {k: statistics.median(v) for k, v in rec.items()}
    out["read_limit"] = out["ours_bytes"] / statistics.median(limits)
    return out


def ds_worker(rank: int, world: int, port: int, args, root: str, out_path: str) -> None:
    start(rank, world, port)
    results = {}
    args.keep_last = False
    for stage in args.stages:
        engine = ds_engine(stage, args.params_m, overlap=False)
        hooks = engine._ckpt_plugins

        def ours_save(path: str, overlap: bool) -> None:
            hooks.overlap = hooks.async_save = overlap
            engine.save_checkpoint(path, tag="t")
            hooks.overlap = hooks.async_save = False

        ds_step(engine, 0)
        side = Side(native_save=lambda p: type(engine).save_checkpoint(engine, p, tag="t"), ours_save=ours_save,
                    native_load=lambda p: hooks.native_load(p, "t"), ours_load=lambda p: engine.load_checkpoint(p, "t"),
                    step=lambda seed: ds_step(engine, seed), state=lambda: ds_local_state(engine),
                    checkpoint=lambda p: os.path.join(p, "t"))
        results[f"ZeRO-{stage}"] = measure(side, args, root, f"ZeRO-{stage}")
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


# ------------------------------------------------------------------ Megatron-core


def gpt_arguments(params_m: float, native_async: bool) -> list:
    """Megatron arguments of a Llama-shaped GPTModel of about `params_m` million parameters."""
    if params_m < 1:
        hidden, layers, vocab = 32, 2, 512
    else:
        hidden, vocab = 1024, 32000
        layers = max(1, round((params_m * 1e6 - 2 * vocab * hidden) / (12 * hidden * hidden)))
    return (f"--num-layers {layers} --hidden-size {hidden} --ffn-hidden-size {hidden * 8 // 3 // 64 * 64} "
            f"--num-attention-heads {max(2, hidden // 64)} --seq-length 32 --max-position-embeddings 32 "
            f"--vocab-size {vocab} --micro-batch-size 1 --global-batch-size 2 --lr 1e-4 --bf16 "
            "--use-distributed-optimizer --swiglu --normalization RMSNorm --position-embedding-type rope "
            "--disable-bias-linear --untie-embeddings-and-output-weights --transformer-impl local "
            "--use-cpu-initialization --hidden-dropout 0 --attention-dropout 0 --no-bias-dropout-fusion "
            "--no-bias-swiglu-fusion --no-rope-fusion --no-masked-softmax-fusion --no-gradient-accumulation-fusion "
            "--no-persist-layer-norm --train-iters 1000 --lr-decay-iters 1000 --distributed-backend gloo "
            "--ckpt-format torch_dist --ckpt-backend bytecheckpoint --save-interval 1000"
            + (" --async-save --use-persistent-ckpt-worker --async-strategy mcore" if native_async else "")).split()


def megatron_job(params_m: float, tp: int, root: str, native_async: bool = False):
    """Megatron's arguments (with the ckpt_plugins flags) and a GPTModel, its distributed optimizer
    and scheduler at TP `tp`, over the existing gloo group; the CPU shim installed first."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    import megatron_shim
    megatron_shim.install()
    import megatron_ext.training as bcp
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.training import global_vars
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.training.training import (get_megatron_ddp_config, get_megatron_optimizer_config,
                                            get_optimizer_param_scheduler)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    sys.argv = ["bench", *gpt_arguments(params_m, native_async), "--tensor-model-parallel-size", str(tp), "--save", root,
                "--load", root]
    args = parse_args(extra_args_provider=bcp.add_arguments)
    validate_args(args)
    global_vars.unset_global_variables()
    global_vars.set_args(args)
    bcp.install()
    parallel_state.initialize_model_parallel(tp, 1)
    from megatron.core.num_microbatches_calculator import (init_num_microbatches_calculator,
                                                           unset_num_microbatches_calculator)
    unset_num_microbatches_calculator()  # Megatron's load reads it
    init_num_microbatches_calculator(dist.get_rank(), None, args.global_batch_size, args.micro_batch_size,
                                     parallel_state.get_data_parallel_world_size())
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = core_transformer_config_from_args(args)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                   vocab_size=args.vocab_size, max_sequence_length=args.max_position_embeddings,
                   position_embedding_type="rope", share_embeddings_and_output_weights=False)
    model = DistributedDataParallel(config=config, ddp_config=get_megatron_ddp_config(args),
                                    module=Float16Module(config, gpt))
    opt_config, overrides = get_megatron_optimizer_config(args)
    opt = get_megatron_optimizer(opt_config, [model], config_overrides=overrides)
    config.no_sync_func, config.finalize_model_grads_func = model.no_sync, finalize_model_grads
    from megatron.training import async_utils
    if native_async and async_utils._async_calls_queue is None:  # --async-save's worker, as Megatron starts it
        async_utils.init_persistent_async_worker(dist.get_rank(), "forkserver")
    args.async_save = False  # per save, below
    return args, model, opt, get_optimizer_param_scheduler(opt)


def megatron_step(model, opt, sched, args, seed: int) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func
    ids = torch.randint(0, args.vocab_size, (1, args.seq_length + 1), generator=torch.Generator().manual_seed(seed))
    s = args.seq_length
    mask = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)

    def forward_step(_, m):
        out = m(ids[:, :-1], torch.arange(s).unsqueeze(0), mask, labels=ids[:, 1:])
        return out, lambda o: (o.float().mean(), {})

    model.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                                num_microbatches=1, seq_length=s, micro_batch_size=1, forward_only=False)
    opt.step()
    sched.step(increment=args.global_batch_size)


def megatron_local_state(model, opt) -> dict:
    """This rank's weights, fp32 main parameters (the distributed optimizer's shards) and moments."""
    out = {f"w{i}": p.detach().clone() for i, p in enumerate(model.parameters())}
    for j, inner in enumerate(o.optimizer for o in opt.chained_optimizers):
        for g, group in enumerate(inner.param_groups):
            out.update({f"m{j}.{g}.{i}": p.detach().clone() for i, p in enumerate(group["params"])})
        for i, s in enumerate(inner.state.values()):
            out.update({f"o{j}.{i}/{k}": v.detach().clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def megatron_done(margs) -> None:
    """Stop --async-save's worker process, if any, else this process cannot exit."""
    from megatron.training.async_utils import _async_calls_queue, maybe_finalize_async_save
    if _async_calls_queue is None:
        return
    margs.async_save = True  # (Megatron skips it otherwise)
    maybe_finalize_async_save(blocking=True, terminate=True)


def megatron_worker(rank: int, world: int, port: int, args, root: str, out_path: str) -> None:
    start(rank, world, port)
    results = {}
    for tp in args.tp:
        margs, model, opt, sched = megatron_job(args.params_m, tp, root, args.native_async)
        from megatron.training import checkpointing  # (once megatron_job installed the CPU shim)

        from megatron.training.async_utils import maybe_finalize_async_save

        def ours_save(path: str, overlap: bool) -> None:
            margs.ckpt_backend, margs.save, margs.ckpt_overlap, margs.async_save = "bytecheckpoint", path, overlap, False
            checkpointing.save_checkpoint(1, [model], opt, sched, 0.0, checkpointing_context={})

        def native_save(path: str) -> None:
            margs.ckpt_backend, margs.save, margs.async_save = "native", path, False
            checkpointing.save_checkpoint(1, [model], opt, sched, 0.0, checkpointing_context={})

        def native_async(path: str) -> tuple:
            """--async-save: the call, then Megatron's own finalization (its train loop's), fsynced."""
            margs.ckpt_backend, margs.save, margs.async_save = "native", path, True
            t = time.perf_counter()
            checkpointing.save_checkpoint(1, [model], opt, sched, 0.0, checkpointing_context={})
            stall = time.perf_counter() - t
            maybe_finalize_async_save(blocking=True)
            fsync_tree(path)
            margs.async_save = False
            return stall, time.perf_counter() - t

        def load(backend: str, path: str) -> None:
            margs.ckpt_backend, margs.load = backend, path
            checkpointing.load_checkpoint([model], opt, sched, checkpointing_context={})

        megatron_step(model, opt, sched, margs, 0)
        side = Side(native_save=native_save, ours_save=ours_save, native_load=lambda p: load("native", p),
                    ours_load=lambda p: load("bytecheckpoint", p),
                    step=lambda seed: megatron_step(model, opt, sched, margs, seed),
                    state=lambda: megatron_local_state(model, opt),
                    checkpoint=lambda p: os.path.join(p, "iter_0000001"),
                    native_async=native_async if args.native_async else None)
        args.keep_last = tp == 1 and not args.tiny  # for the resharded loads
        # Megatron's own load leaves the Adam step counts as they were on the torch-AdamW path (an
        # upstream bug without TE/Apex: see tests/megatron_shim.py): not checked for it
        layout = f"TP{tp}" if tp > 1 else f"DP{world}"
        results[layout] = measure(side, args, os.path.join(root, layout), layout,
                                  skip_native=lambda key: key.endswith("/step"))
        if args.keep_last and rank == 0:  # with the weights the resharded loads must give
            torch.save([p.detach().clone() for p in model.parameters()], os.path.join(root, "weights.pt"))
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
        dist.barrier()
    megatron_done(margs)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def megatron_resharded_worker(rank: int, world: int, port: int, args, root: str, out_path: str) -> None:
    """One process loads the DP2 checkpoints both ways (Megatron's torch_dist reshards over DP)."""
    start(rank, world, port)
    margs, model, opt, sched = megatron_job(args.params_m, 1, root)
    from megatron.training import checkpointing
    megatron_step(model, opt, sched, margs, 7)  # Megatron's optimizer loads only once it has stepped
    weights = torch.load(os.path.join(root, "weights.pt"))
    results = {}
    for name, backend in (("native_load", "native"), ("ours_load", "bytecheckpoint")):
        path = os.path.join(root, "DP2", f"{name.split('_')[0]}{args.reps}")
        margs.ckpt_backend, margs.load = backend, path
        drop_cache(path)
        t = time.perf_counter()
        checkpointing.load_checkpoint([model], opt, sched, checkpointing_context={})
        results[name] = time.perf_counter() - t
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters())), f"DP2 -> DP1 {name}: weights"
        megatron_step(model, opt, sched, margs, 8)
    megatron_done(margs)
    with open(out_path, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver


def run(worker, args, root: str, world: int = 2) -> dict:
    out = os.path.join(root, "results.json")
    mp.start_processes(worker, args=(world, free_port(), args, root, out), nprocs=world, join=True,
                       start_method="spawn")
    with open(out) as f:
        return json.load(f)


def report(framework: str, results: dict) -> None:
    print(f"\n{framework}: seconds (medians); GiB stored; ratios ours / native, and ours / the machine's read limit")
    print(f"{'layout':8} {'GiB n/o':>11} {'native save':>11} {'ours sync':>9} {'overlap stall':>13} "
          f"{'overlap commit':>14} {'native load':>11} {'ours load':>9} {'read limit':>10}   ratios")
    for layout, r in results.items():
        if "native_save" not in r:  # a resharded load
            print(f"{layout:8} {'':>11} {'':>11} {'':>9} {'':>13} {'':>14} {r['native_load']:11.3f} {r['ours_load']:9.3f} "
                  f"{'':>10}   load {r['ours_load'] / r['native_load']:.2f}")
            continue
        # the overlapped stall against native's asynchronous one where it has one, else its save
        against = r.get("native_async_stall", r["native_save"])
        ratios = (f"sync {r['ours_sync'] / r['native_save']:.2f}, stall {r['ours_overlap_stall'] / against:.3f}, "
                  f"commit {r['ours_overlap_commit'] / r.get('native_async_commit', r['native_save']):.2f}, "
                  f"load {r['ours_load'] / r['native_load']:.2f} / limit {r['ours_load'] / r['read_limit']:.2f}")
        if "native_async_stall" in r:
            ratios += (f"; native --async-save: stall {r['native_async_stall']:.3f}, "
                       f"commit {r['native_async_commit']:.3f}")
        gib = f"{r['native_bytes'] / 2**30:.2f}/{r['ours_bytes'] / 2**30:.2f}"
        print(f"{layout:8} {gib:>11} {r['native_save']:11.3f} {r['ours_sync']:9.3f} {r['ours_overlap_stall']:13.4f} "
              f"{r['ours_overlap_commit']:14.3f} {r['native_load']:11.3f} {r['ours_load']:9.3f} {r['read_limit']:10.3f}   "
              f"{ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=["deepspeed", "megatron", "all"], default="all")
    parser.add_argument("--params-m", type=float, default=200.0, help="model size, millions of parameters")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    parser.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2],
                        help="Megatron layouts: DP2, TP2")
    parser.add_argument("--tiny", action="store_true", help="the fixed cost: 0.1M parameters, 15 repetitions")
    parser.add_argument("--world", type=int, default=2,
                        help="DeepSpeed's processes (1: a single-process job, where no rank exchanges)")
    parser.add_argument("--native-async", action="store_true",
                        help="Megatron's own --async-save too (its persistent worker process); a 200M run "
                             "with it did not finish in 25 minutes here")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: the temp dir)")
    args = parser.parse_args()
    if args.tiny:
        args.params_m, args.reps = 0.1, 15
    if args.framework in ("deepspeed", "all"):
        root = tempfile.mkdtemp(prefix="bench_native_", dir=args.dir)
        try:
            report("DeepSpeed", run(ds_worker, args, root, world=args.world))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if args.framework in ("megatron", "all"):
        root = tempfile.mkdtemp(prefix="bench_native_", dir=args.dir)
        # --async-save writes in a forkserver process, which imports megatron before any code of
        # ours runs: a sitecustomize on its PYTHONPATH installs the CPU shim there first
        site = os.path.join(root, "site")
        os.makedirs(site)
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write("import megatron_shim\nmegatron_shim.install()\n")
        tests = os.path.join(os.path.dirname(HERE), "tests")
        os.environ["PYTHONPATH"] = os.pathsep.join([site, tests] + os.environ.get("PYTHONPATH", "").split(os.pathsep))
        try:
            results = run(megatron_worker, args, root)
            if not args.tiny:
                resharded = run(megatron_resharded_worker, args, root, world=1)
                results["DP2 -> DP1"] = resharded
            report("Megatron-core (distributed optimizer)", results)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
