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
own torch_dist (sync, and `--async-save`); resharded loads DP2 -> DP1. Megatron calls CUDA where
a GPU run would: the tests' CPU shim (`tests/megatron_shim.py`) redirects those calls, here as in
the tests; DeepSpeed needs no shim (its CPU accelerator), only its shared-memory op left unbuilt.

Measured per method: the stall (how long the save call blocks), the time to a committed durable
checkpoint, same-layout loads (page cache dropped) and resharded loads where the framework can
do one, medians of `--reps`; every load is checked bit for bit against the state saved (but
Megatron's own load's Adam step counts, which it leaves as they were on the torch-AdamW path
without TE/Apex, an upstream bug), and every checkpoint deleted after use. `--tiny` measures the fixed cost instead: a 0.1M-parameter model,
medians of many saves and loads (page cache kept).

Run: .venv/bin/python bench/native.py                       (both frameworks, about 20 minutes)
     .venv/bin/python bench/native.py --framework deepspeed --params-m 20 --reps 1   (a smoke run)
     .venv/bin/python bench/native.py --tiny
"""
from __future__ import annotations

import argparse
import importlib
import json
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from save_load import drop_cache  # noqa: E402  (the bench's own helpers)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def slowest(seconds: float) -> float:
    """The slowest rank's seconds (every rank calls it)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


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


def same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def ds_worker(rank: int, world: int, port: int, args, root: str, out_path: str) -> None:
    start(rank, world, port)
    import ckpt_plugins as cp
    results = {}
    for stage in args.stages:
        engine = ds_engine(stage, args.params_m, overlap=False)
        hooks = engine._ckpt_plugins
        native_save, native_load = type(engine).save_checkpoint, hooks.native_load
        ds_step(engine, 0)
        saved = ds_local_state(engine)
        rec = {k: [] for k in ("native_save", "ours_sync", "ours_overlap_stall", "ours_overlap_commit",
                                "native_load", "ours_load")}

        def timed(fn) -> float:
            dist.barrier()
            t = time.perf_counter()
            fn()
            return slowest(time.perf_counter() - t)

        reps = args.reps + 1  # the first of each is unmeasured (one-time costs: plans, staging, files)
        for rep in range(reps):
            native_dir, ours_dir = os.path.join(root, f"native{rep % 2}"), os.path.join(root, f"ours{rep % 2}")
            t = timed(lambda: (native_save(engine, native_dir, tag="t"), fsync_tree(native_dir)))
            if rep:
                rec["native_save"].append(t)
            t = timed(lambda: engine.save_checkpoint(ours_dir, tag="t"))
            if rep:
                rec["ours_sync"].append(t)
            hooks.overlap = hooks.async_save = True
            dist.barrier()
            t0 = time.perf_counter()
            engine.save_checkpoint(ours_dir + "o", tag="t")
            stall = time.perf_counter() - t0
            cp.checkpointer().wait()
            commit = time.perf_counter() - t0
            hooks.overlap = hooks.async_save = False
            if rep:
                rec["ours_overlap_stall"].append(slowest(stall))
                rec["ours_overlap_commit"].append(slowest(commit))
            ds_step(engine, rep + 1)  # the state moves on: each load must bring the saved one back
            for name, load, path in (("native_load", lambda p: native_load(p, "t"), native_dir),
                                     ("ours_load", lambda p: engine.load_checkpoint(p, "t"), ours_dir)):
                cold(path)
                t = timed(lambda: load(path))
                if rep:
                    rec[name].append(t)
                assert same(saved, ds_local_state(engine)), f"ZeRO-{stage} {name}: not the saved state"
                ds_step(engine, 100 + rep)
            engine.load_checkpoint(ours_dir, "t")  # the saved state again, for the next saves
            dist.barrier()
            if rank == 0:
                for d in (native_dir, ours_dir, ours_dir + "o"):
                    shutil.rmtree(d, ignore_errors=True)
            dist.barrier()
        results[f"ZeRO-{stage}"] = {k: statistics.median(v) for k, v in rec.items()}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


# ------------------------------------------------------------------ Megatron-core


def gpt_arguments(params_m: float) -> list:
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
            "--ckpt-format torch_dist --ckpt-backend bytecheckpoint --save-interval 1000").split()


def megatron_job(params_m: float, tp: int, root: str):
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
    sys.argv = ["bench", *gpt_arguments(params_m), "--tensor-model-parallel-size", str(tp), "--save", root,
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


def megatron_worker(rank: int, world: int, port: int, args, root: str, out_path: str) -> None:
    start(rank, world, port)
    import ckpt_plugins as cp
    results = {}
    for tp in args.tp:
        margs, model, opt, sched = megatron_job(args.params_m, tp, root)
        from megatron.training import checkpointing  # (once megatron_job installed the CPU shim)
        megatron_step(model, opt, sched, margs, 0)
        saved = megatron_local_state(model, opt)
        rec = {k: [] for k in ("native_save", "ours_sync", "ours_overlap_stall", "ours_overlap_commit",
                                "native_load", "ours_load")}

        def timed(fn) -> float:
            dist.barrier()
            t = time.perf_counter()
            fn()
            return slowest(time.perf_counter() - t)

        def save(backend: str, path: str, overlap: bool = False) -> None:
            margs.ckpt_backend, margs.save, margs.ckpt_overlap = backend, path, overlap
            checkpointing.save_checkpoint(1, [model], opt, sched, 0.0, checkpointing_context={})

        def load(backend: str, path: str) -> None:
            margs.ckpt_backend, margs.load = backend, path
            checkpointing.load_checkpoint([model], opt, sched, checkpointing_context={})

        for rep in range(args.reps + 1):  # the first of each is unmeasured (one-time costs)
            native_dir = os.path.join(root, f"tp{tp}-native{rep % 2}")
            ours_dir, overlap_dir = os.path.join(root, f"tp{tp}-ours{rep % 2}"), os.path.join(root, f"tp{tp}-overlap")
            measured = {"native_save": timed(lambda: (save("native", native_dir), fsync_tree(native_dir))),
                        "ours_sync": timed(lambda: save("bytecheckpoint", ours_dir))}
            dist.barrier()
            t0 = time.perf_counter()
            save("bytecheckpoint", overlap_dir, overlap=True)
            stall = time.perf_counter() - t0
            cp.checkpointer().wait()
            measured.update(ours_overlap_stall=slowest(stall), ours_overlap_commit=slowest(time.perf_counter() - t0))
            megatron_step(model, opt, sched, margs, rep + 1)  # the state moves on: each load brings it back
            for name, backend, path in (("native_load", "native", native_dir), ("ours_load", "bytecheckpoint", ours_dir)):
                cold(path)
                measured[name] = timed(lambda: load(backend, path))
                got = megatron_local_state(model, opt)
                # Megatron's own load leaves the Adam step counts as they were on the torch-AdamW path
                # (an upstream bug without TE/Apex: see tests/megatron_shim.py): not checked for it
                bad = [k for k in saved if not (name == "native_load" and k.endswith("/step"))
                       and (k not in got or not torch.equal(saved[k], got[k]))]
                assert not bad, (f"TP{tp} {name}: not the saved state", [(k, saved[k], got.get(k)) for k in bad][:3])
                megatron_step(model, opt, sched, margs, 100 + rep)
            load("bytecheckpoint", ours_dir)  # the saved state again, for the next saves
            if rep:
                for k, v in measured.items():
                    rec[k].append(v)
        results[f"DP{world // tp} x TP{tp}" if tp > 1 else f"DP{world}"] = {k: statistics.median(v) for k, v in rec.items()}
        if tp == 1 and rank == 0:  # kept for the resharded loads, with the weights they must give
            torch.save([p.detach().clone() for p in model.parameters()], os.path.join(root, "weights.pt"))
            for name in ("native", "ours"):
                os.rename(os.path.join(root, f"tp1-{name}{args.reps % 2}"), os.path.join(root, f"resharded-{name}"))
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
        dist.barrier()
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
        path = os.path.join(root, f"resharded-{name.split('_')[0]}")
        margs.ckpt_backend, margs.load = backend, path
        drop_cache(path)
        t = time.perf_counter()
        checkpointing.load_checkpoint([model], opt, sched, checkpointing_context={})
        results[name] = time.perf_counter() - t
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters())), f"DP2 -> DP1 {name}: weights"
        megatron_step(model, opt, sched, margs, 8)
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
    print(f"\n{framework}: seconds (medians); ours / native")
    print(f"{'layout':10} {'native save':>12} {'ours sync':>10} {'overlap stall':>14} {'overlap commit':>15} "
          f"{'native load':>12} {'ours load':>10}   ratios")
    for layout, r in results.items():
        if "native_save" not in r:  # a resharded load
            print(f"{layout:10} {'':>12} {'':>10} {'':>14} {'':>15} {r['native_load']:12.3f} {r['ours_load']:10.3f}   "
                  f"load {r['ours_load'] / r['native_load']:.2f}")
            continue
        ratios = (f"sync {r['ours_sync'] / r['native_save']:.2f}, stall {r['ours_overlap_stall'] / r['native_save']:.3f}, "
                  f"commit {r['ours_overlap_commit'] / r['native_save']:.2f}, load {r['ours_load'] / r['native_load']:.2f}")
        print(f"{layout:10} {r['native_save']:12.3f} {r['ours_sync']:10.3f} {r['ours_overlap_stall']:14.4f} "
              f"{r['ours_overlap_commit']:15.3f} {r['native_load']:12.3f} {r['ours_load']:10.3f}   {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=["deepspeed", "megatron", "all"], default="all")
    parser.add_argument("--params-m", type=float, default=200.0, help="model size, millions of parameters")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    parser.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2],
                        help="Megatron layouts: DP2, TP2")
    parser.add_argument("--tiny", action="store_true", help="the fixed cost: 0.1M parameters, 15 repetitions")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: the temp dir)")
    args = parser.parse_args()
    if args.tiny:
        args.params_m, args.reps = 0.1, 15
    if args.framework in ("deepspeed", "all"):
        root = tempfile.mkdtemp(prefix="bench_native_", dir=args.dir)
        try:
            report("DeepSpeed", run(ds_worker, args, root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if args.framework in ("megatron", "all"):
        root = tempfile.mkdtemp(prefix="bench_native_", dir=args.dir)
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
