"""`--ckpt-backend bytecheckpoint` in Megatron's own training code (megatron.training arguments,
save_checkpoint/load_checkpoint, latest_checkpointed_iteration.txt) and `bcp import-megatron` of a
native torch_dist checkpoint written by the same code."""
import os
import subprocess
import sys

import pytest
import torch

import ckpt_plugins as cp
from ckpt_plugins._src.storage import storage_for
from ckpt_plugins._src.trace import load_telemetry
from distributed import run_ranks


def megatron_args(tp, pp, save, *extra):
    """Megatron's parsed and validated arguments for this rank, with our provider, set globally."""
    import torch.distributed as dist
    import megatron_shim
    megatron_shim.install()
    import megatron_ext.training as bcp
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args

    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()), LOCAL_RANK=str(dist.get_rank()),
                      CUDA_DEVICE_MAX_CONNECTIONS="1")
    sys.argv = ["pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "64",
                "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
                "--seq-length", "12", "--max-position-embeddings", "12", "--micro-batch-size", "1",
                "--global-batch-size", "4", "--lr", "0.01", "--train-iters", "10", "--save-interval", "1", "--bf16",
                "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                "--use-distributed-optimizer", "--save", save, "--load", save, "--vocab-size", "96",
                # the model megatron_util builds: Llama-shaped, local layer spec
                "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--transformer-impl", "local",
                *extra]
    args = parse_args(extra_args_provider=bcp.add_arguments)
    validate_args(args, {})
    global_vars.unset_global_variables()
    global_vars.set_args(args)
    return args


def hooked_job(tp, pp, save, seed=0):
    """Megatron's arguments with `--ckpt-backend bytecheckpoint`, our hook installed, and a bf16
    GPTModel with its distributed optimizer and scheduler: (args, model, optimizer, scheduler)."""
    args = megatron_args(tp, pp, save, "--ckpt-backend", "bytecheckpoint")
    import megatron_util as mu
    import megatron_ext.training as bcp
    bcp.install()
    mu.init_parallel(tp, pp)
    model = mu.build_gpt(seed, dtype=torch.bfloat16)
    opt = mu.build_optimizer(model)
    return args, model, opt, mu.build_scheduler(opt)


def hook_worker(rank, world, root, native):
    args = megatron_args(2, 2, root, "--ckpt-backend", "bytecheckpoint")
    import megatron_util as mu
    import megatron_ext.training as bcp
    from megatron.training import checkpointing, training

    bcp.install()
    mu.init_parallel(2, 2)
    model = mu.build_gpt(0, dtype=torch.bfloat16)
    opt = mu.build_optimizer(model)
    sched = mu.build_scheduler(opt)
    mu.megatron_train_step(model, opt, sched, 0)  # Megatron's own, as pretrain() runs it: warms the first save up
    mu.train_step(model, opt, 1)
    sched.step(increment=4)
    args.consumed_train_samples = 8
    args.ckpt_backend, args.save = "native", native  # Megatron's own torch_dist, for the import test
    training.save_checkpoint(2, [model], opt, sched, 123.0)
    args.ckpt_backend, args.save = "bytecheckpoint", root
    training.save_checkpoint(2, [model], opt, sched, 123.0)  # the name training.py calls
    with open(os.path.join(root, bcp.TRACKER)) as f:
        assert f.read() == "2"
    assert cp.read_metadata(os.path.join(root, "iter_0000002")).framework == "megatron"
    args_entry, = cp.read_metadata(os.path.join(root, "iter_0000002")).objects["megatron/args"]
    assert args_entry.encoding == "json"  # readable without megatron's types (exit_signal is an enum)
    for r in load_telemetry(storage_for(os.path.join(root, "iter_0000002")))["ranks"]:
        assert r.phase("plan").info["cached"] and r.phase("staging").bytes == 0, r  # warmed up
    draws = torch.rand(3)
    losses = [mu.train_step(model, opt, 2 + i) for i in range(2)]
    mu.destroy()

    # resume at TP1 × PP2 (DP2): Megatron's load_checkpoint, as pretrain() calls it
    args = megatron_args(1, 2, root, "--ckpt-backend", "bytecheckpoint")
    mu.init_parallel(1, 2)
    model = mu.build_gpt(9, dtype=torch.bfloat16)
    opt = mu.build_optimizer(model)
    sched = mu.build_scheduler(opt)
    assert checkpointing.load_checkpoint([model], opt, sched) == (2, 123.0)
    assert args.consumed_train_samples == 8 and sched.num_steps == 8
    assert torch.equal(torch.rand(3), draws)  # same rank count: each rank's generators restored
    resumed = [mu.train_step(model, opt, 2 + i) for i in range(2)]
    for got, want in zip(resumed, losses):
        assert abs(got - want) <= 2e-3 * abs(want), (resumed, losses)

    # --finetune: weights only, iteration 0, masters follow the weights
    args.finetune = True
    model = mu.build_gpt(9, dtype=torch.bfloat16)
    opt = mu.build_optimizer(model)
    assert checkpointing.load_checkpoint([model], opt, None) == (0, 123.0)
    assert not any(opt.chained_optimizers[0].optimizer.state.values())
    finetuned = [p.detach().clone() for p in model.parameters()]

    # --load at an HF directory (this checkpoint's weights, exported): read in place, iteration 0,
    # the same weights as the --finetune load of the checkpoint itself
    import torch.distributed as dist
    from hf_ext.safetensors_io import export_hf
    hf_dir = os.path.join(os.path.dirname(root), "hf")
    if dist.get_rank() == 0:
        export_hf(os.path.join(root, "iter_0000002"), hf_dir)
    dist.barrier()
    args.finetune, args.load = False, hf_dir
    model = mu.build_gpt(10, dtype=torch.bfloat16)
    opt = mu.build_optimizer(model)
    assert checkpointing.load_checkpoint([model], opt, sched) == (0, 0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), finetuned))
    mu.destroy()


def test_ckpt_backend_flag_saves_and_resumes_through_megatron_training_and_imports_native(tmp_path):
    ours, native, imported = (str(tmp_path / d) for d in ("ours", "native", "imported"))
    run_ranks(4, hook_worker, ours, native)

    # bcp import-megatron: Megatron's own torch_dist checkpoint of the same state gives the same
    # canonical tensors, bit for bit, as ckpt_plugins saved from the live TP2 x PP2 job
    out = subprocess.run([sys.executable, "-m", "ckpt_plugins.cli", "import-megatron", native, imported],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "iteration 2" in out.stdout
    assert_same_canonical_state(os.path.join(ours, "iter_0000002"), imported, 60)
    assert_read_in_place_as_imported(native, imported)

    # and straight into transformers' Llama: under FSDP2 on 2 ranks, and with AdamW on one process
    run_ranks(2, fsdp2_from_torch_dist, native, imported)
    from megatron_ext.native import resolve
    from ckpt_plugins._src.offline import open_checkpoint, read_tensor
    from hf_models import train_step
    hf = hf_llama()
    params = list(hf.to(torch.bfloat16).parameters())  # grouped as Megatron groups them: no decay for 1-D
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                             {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}])
    cp.load(resolve(native), {"model": hf, "optim": opt})
    storage, meta = open_checkpoint(imported)
    for name, p in hf.named_parameters():
        assert torch.equal(p, read_tensor(storage, meta, f"model/{name}")), name
        moment = read_tensor(storage, meta, f"optim/{name}/exp_avg").to(p.dtype)  # as load_state_dict casts it
        assert torch.equal(opt.state[p]["exp_avg"], moment), name
        assert opt.state[p]["step"] == read_tensor(storage, meta, f"optim/{name}/step"), name
    train_step(hf, opt, 0)  # (torch's Adam refuses fp32 moments of bf16 parameters)


def torch_dcp_worker(rank, world, root):
    """Megatron's torch_dcp layout: its own generate_state_dict, saved by DCP as its save_checkpoint
    does (validate_args allows the format only with torch FSDP2, whose device mesh Megatron makes
    on CUDA; the layout is the same: whole parameters under "model.<name>"); and our own save of
    the same model."""
    megatron_args(1, 1, os.path.join(root, "unused"))
    import megatron_util as mu
    import torch.distributed.checkpoint as dcp
    from megatron.training import checkpointing, get_args
    from megatron_ext import MegatronModel
    mu.init_parallel(1, 1)
    model = mu.build_gpt(4, dtype=torch.bfloat16)
    args = get_args()
    args.ckpt_format = "torch_dcp"
    dcp.save(checkpointing.generate_state_dict(args, [model], None, None, None, iteration=5),
             checkpoint_id=os.path.join(root, "torch_dcp"))
    cp.save(os.path.join(root, "ours"), {"model": MegatronModel(model)})
    mu.destroy()


def overlapped_save_worker(rank, world, root):
    """--async-save (overlapped by default) with the distributed optimizer's overlapped gradient reduce-scatter and
    parameter all-gather: the save returns before its snapshot, which here starts only once the
    next optimizer step has been called; that step waits for it, the forward and backward do not.
    With --ckpt-host-memory below the save, which then streams through it, compressed (--ckpt-compress)."""
    import threading

    import megatron_util as mu
    import megatron_ext.training as bcp
    from faults import snapshots_held
    megatron_args(1, 1, root, "--ckpt-backend", "bytecheckpoint", "--async-save", "--use-persistent-ckpt-worker",
                  "--overlap-grad-reduce",
                  "--overlap-param-gather", "--ckpt-host-memory", "64KiB", "--ckpt-compress")  # (installs the CPU shim first)
    from megatron.training import checkpointing, training
    bcp.install()
    mu.init_parallel(1, 1)
    model = mu.build_gpt(0, dtype=torch.bfloat16, overlap=True)
    assert model.use_forward_hook  # the parameter all-gather overlaps the next forward
    assert all(p.device == mu.device() for p in model.parameters())  # on the GPU where there is one
    opt = mu.build_optimizer(model)
    sched = mu.build_scheduler(opt)
    for i in range(2):
        mu.megatron_train_step(model, opt, sched, i)
    training.force_param_sync([model], opt)  # what train() does before it saves
    saved = [p.detach().clone() for p in model.parameters()] + [
        t.clone() for s in opt.chained_optimizers[0].optimizer.state.values() for t in s.values()]

    with snapshots_held() as go:
        training.save_checkpoint(2, [model], opt, sched, 0.0)
        handle = cp.checkpointer()._last
        assert not handle._snapshot.is_set()  # returned before the snapshot
        gated = opt.step

        def step(*args, **kwargs):  # the snapshot may start 0.3 s after the step was called
            threading.Timer(0.3, go.set).start()
            return gated(*args, **kwargs)

        opt.step = step
        mu.megatron_train_step(model, opt, sched, 2)
    info = handle.wait()
    # bigger than the budget: streamed through it, the snapshot waiting for the writes
    assert info.rank_bytes > 64 << 10 >= cp.checkpointer().pool.allocated_bytes > 0
    assert any(b.group for t in cp.read_metadata(handle.path).tensors.values() for b in t.boxes)
    mu.megatron_train_step(model, opt, sched, 3)  # the next forward finishes the parameter all-gather
    assert not torch.equal(saved[0], next(model.parameters()))  # training went on

    fresh = mu.build_gpt(9, dtype=torch.bfloat16, overlap=True)
    fresh_opt = mu.build_optimizer(fresh)
    fresh_sched = mu.build_scheduler(fresh_opt)
    mu.megatron_train_step(fresh, fresh_opt, fresh_sched, 5)  # Megatron's optimizer loads only once it has stepped
    assert checkpointing.load_checkpoint([fresh], fresh_opt, fresh_sched)[0] == 2
    loaded = [p.detach() for p in fresh.parameters()] + [
        t for s in fresh_opt.chained_optimizers[0].optimizer.state.values() for t in s.values()]
    assert len(loaded) == len(saved) and all(torch.equal(a, b) for a, b in zip(saved, loaded))

    # train() ends with Megatron's blocking finalize: the save pending then is committed when it returns
    with snapshots_held() as go:
        training.save_checkpoint(3, [fresh], fresh_opt, fresh_sched, 0.0)
        threading.Timer(0.3, go.set).start()
        training.maybe_finalize_async_save(blocking=True, terminate=True)
        assert cp.checkpointer()._last.done()
        with open(os.path.join(root, bcp.TRACKER)) as f:
            assert f.read() == "3"

    # --ckpt-compress auto: compressed only where that shortens the commit, which loads as any save;
    # --no-ckpt-overlap: the asynchronous save returns once its snapshot is taken
    args = megatron_args(1, 1, os.path.join(root, "auto"), "--ckpt-backend", "bytecheckpoint", "--ckpt-compress", "auto",
                         "--async-save", "--use-persistent-ckpt-worker", "--no-ckpt-overlap")
    assert args.ckpt_compress == "auto"
    training.save_checkpoint(3, [fresh], fresh_opt, fresh_sched, 0.0)
    assert cp.checkpointer()._last._snapshot.is_set() and cp.checkpointer().compress == "auto"
    cp.checkpointer().wait()
    assert checkpointing.load_checkpoint([model], opt, sched)[0] == 3
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    with pytest.raises(SystemExit):  # Megatron's parser: invalid choice
        megatron_args(1, 1, root, "--ckpt-backend", "bytecheckpoint", "--ckpt-compress", "fast")
    mu.destroy()


def test_an_overlapped_save_holds_the_optimizer_step_not_the_forward_and_backward(tmp_path):
    run_ranks(2, overlapped_save_worker, str(tmp_path))


def test_megatron_torch_dcp_checkpoint_loads_in_place_into_an_hf_model(tmp_path):
    """A torch_dcp directory is recognised as Megatron's (its args give the sizes) and fills
    transformers' Llama with the weights our own save of the same Megatron model holds."""
    from ckpt_plugins._src.offline import open_checkpoint, read_tensor
    run_ranks(1, torch_dcp_worker, str(tmp_path))
    path = tmp_path / "torch_dcp"
    assert cp.checkpoint_format(path) == "Megatron torch_dcp"
    hf = hf_llama().to(torch.bfloat16)
    cp.load(path, {"model": hf})
    storage, meta = open_checkpoint(tmp_path / "ours")
    for name, p in hf.named_parameters():
        assert torch.equal(p, read_tensor(storage, meta, f"model/{name}")), name


def memory_worker(rank, world, root, hosts_dir, losses_path):
    """4 ranks (DP4) on hosts a and b: a durable save at iteration 2, a non-persistent one (the
    memory tier) at 3, then the uninterrupted run's next two losses."""
    from test_memory_tier import on_host
    on_host(hosts_dir, "a" if rank < 2 else "b")
    args, model, opt, sched = hooked_job(1, 1, root)  # Megatron importable from here on (its shim)
    import megatron_util as mu
    from megatron.training import training
    args.non_persistent_save_interval = 1
    for i in range(3):
        mu.train_step(model, opt, i)
        args.consumed_train_samples = 4 * (i + 1)
        if i == 1:
            training.save_checkpoint(2, [model], opt, sched, 20.0)
    training.save_checkpoint(3, [model], opt, sched, 30.0, non_persistent_ckpt=True)
    cp.checkpointer().wait()
    assert sorted(os.listdir(root)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]  # 3: memory only
    losses = [mu.train_step(model, opt, 3 + i) for i in range(2)]
    if rank == 0:
        torch.save(losses, losses_path)
    mu.destroy()


def memory_restart_worker(rank, world, root, hosts_dir, losses_path):
    from test_memory_tier import on_host
    on_host(hosts_dir, "a")
    args, model, opt, sched = hooked_job(1, 1, root, seed=9)
    import megatron_util as mu
    from megatron.training import checkpointing
    args.non_persistent_save_interval = 1
    assert checkpointing.load_checkpoint([model], opt, sched) == (3, 30.0)  # memory's 3, not the tracker's 2
    assert args.consumed_train_samples == 12
    resumed = [mu.train_step(model, opt, 3 + i) for i in range(2)]
    for got, want in zip(resumed, torch.load(losses_path)):
        assert abs(got - want) <= 2e-3 * abs(want), (resumed, want)
    mu.destroy()


def test_non_persistent_saves_go_to_the_memory_tier_and_a_restart_on_fewer_ranks_takes_them(tmp_path):
    """`--non-persistent-save-interval` with our backend: Megatron's non-persistent saves go to the
    memory tier; host b is lost, and Megatron's load_checkpoint on the 2 ranks of host a takes the
    newer memory step over the tracker's (DP4 -> DP2, distributed optimizer)."""
    import shutil
    import tempfile
    from ckpt_plugins._src import shm
    hosts_dir = tempfile.mkdtemp(prefix="ckpt-hosts-", dir=shm.SHM_DIR)
    try:
        root, losses = str(tmp_path / "run"), str(tmp_path / "losses.pt")
        run_ranks(4, memory_worker, root, hosts_dir, losses)
        shutil.rmtree(os.path.join(hosts_dir, "b"))
        run_ranks(2, memory_restart_worker, root, hosts_dir, losses)
    finally:
        shutil.rmtree(hosts_dir, ignore_errors=True)


def hf_llama():
    """transformers' Llama of the sizes megatron_args gives Megatron."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))


def fsdp2_from_torch_dist(rank, world, native, imported):
    """A native torch_dist checkpoint loaded in place into an FSDP2 (bf16) Llama: its weights."""
    from torch.distributed.fsdp import fully_shard
    from ckpt_plugins._src.offline import open_checkpoint, read_tensor
    from megatron_ext.native import resolve
    model = hf_llama().to(torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    cp.load(resolve(native), {"model": model, "optim": cp.Ignore()})
    storage, meta = open_checkpoint(imported)
    for name, p in model.state_dict().items():
        assert torch.equal(p.full_tensor(), read_tensor(storage, meta, f"model/{name}")), name


def assert_read_in_place_as_imported(native, imported) -> None:
    """`cp.load` of the native torch_dist directory itself (no import) fills a model's canonical
    weights and the distributed optimizer's masters and moments with exactly what `bcp
    import-megatron` wrote (checked against the live job's own save), reading what it fills once;
    param groups and steps come too."""
    from ckpt_plugins._src.format import dtype_from_name
    from ckpt_plugins._src.offline import open_checkpoint, read_tensor
    from megatron_ext.native import resolve
    path = resolve(native)
    assert cp.checkpoint_format(path) == "Megatron torch_dist"
    from ckpt_plugins._src.committed import read_object
    storage, meta = open_checkpoint(imported)
    keys = [k for k in meta.tensors if k.split("/")[0] in ("model", "optim") and meta.tensors[k].shape]
    live = {"model": {}, "optim": {}}
    for k in keys:
        entry, name = k.split("/", 1)
        live[entry][name] = torch.full(meta.tensors[k].shape, float("nan"), dtype=dtype_from_name(meta.tensors[k].dtype))
    result = cp.load(path, live, strict=False)
    assert result.missing_keys == []
    for key in keys:
        entry, name = key.split("/", 1)
        assert torch.equal(live[entry][name], read_tensor(storage, meta, key)), key
    assert result.read_bytes == result.unverified_bytes == sum(t.nbytes for d in live.values() for t in d.values())
    assert len(live["optim"]) > len(live["model"])  # masters, exp_avg, exp_avg_sq of every parameter
    view = cp.read_metadata(path)
    assert read_object(storage, meta, "optim/param_groups", None) == read_object(storage_for(path), view, "optim/param_groups", None)


def assert_same_canonical_state(ours, imported, at_least):
    """Two checkpoints hold the same weights, optimizer state, scheduler and param groups."""
    from ckpt_plugins._src.offline import open_checkpoint, read_tensor
    from ckpt_plugins._src.committed import read_object
    a_storage, a = open_checkpoint(ours)
    b_storage, b = open_checkpoint(imported)
    trained = {k for k in a.tensors if k.split("/")[0] in ("model", "optim")}
    assert trained == set(b.tensors) and len(trained) > at_least, sorted(trained ^ set(b.tensors))[:5]
    for key in sorted(trained):
        x, y = read_tensor(a_storage, a, key), read_tensor(b_storage, b, key)
        assert x.dtype == y.dtype and torch.equal(x, y), key
    for key in [k for k in a.objects if k.startswith("sched/")] + ["megatron/iteration"]:
        assert read_object(a_storage, a, key, None) == read_object(b_storage, b, key, None), key
    groups = [read_object(s, m, "optim/param_groups", None) for s, m in ((a_storage, a), (b_storage, b))]
    assert sorted(sorted(g["params"]) for g in groups[0]) == sorted(sorted(g["params"]) for g in groups[1])


MOE_ARGS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", "--qk-layernorm",
            "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "1e-3",
            "--expert-model-parallel-size", "2"]


def moe_native_worker(rank, world, root):
    """A Qwen3-MoE-shaped run at EP2 x PP2 (bf16, distributed optimizer): Megatron's own torch_dist
    save, ours, and a bare `dist_checkpointing.save` of the model's sharded_state_dict (what
    Megatron-Bridge and NeMo write: no run arguments)."""
    args = megatron_args(1, 2, os.path.join(root, "native"), *MOE_ARGS)
    import megatron_util as mu
    import megatron_ext.training as bcp
    from megatron.core import dist_checkpointing
    from megatron.training import training
    bcp.install()
    mu.init_parallel(1, 2, ep=2)
    model = mu.build_gpt(0, dtype=torch.bfloat16, moe=mu.MOE)
    opt = mu.build_optimizer(model)
    sched = mu.build_scheduler(opt)
    for step in range(2):
        mu.train_step(model, opt, step)
        sched.step(increment=4)
    training.save_checkpoint(2, [model], opt, sched, 1.0)
    args.ckpt_backend, args.save = "bytecheckpoint", os.path.join(root, "ours")
    training.save_checkpoint(2, [model], opt, sched, 1.0)
    bare = os.path.join(root, "bare")
    if rank == 0:
        os.makedirs(bare)
        with open(os.path.join(root, "config.json"), "w") as f:
            f.write(bcp.hf_config_json(model))
    torch.distributed.barrier()
    dist_checkpointing.save(mu.unwrap(model).sharded_state_dict(), bare)
    mu.destroy()


def test_import_megatron_of_moe_with_expert_parallelism_and_of_checkpoints_without_run_arguments(tmp_path):
    """`bcp import-megatron` of an EP2 x PP2 MoE torch_dist checkpoint: weights, masters, moments
    (the dense and the expert optimizers' buffers) and param groups equal what ckpt_plugins saved
    from the live job. A bare dist_checkpointing.save without run arguments: refused naming
    --hf-config, then imported with it, weights equal."""
    root = str(tmp_path)
    run_ranks(4, moe_native_worker, root)
    bcp = [sys.executable, "-m", "ckpt_plugins.cli", "import-megatron"]
    out = subprocess.run(bcp + [os.path.join(root, "native"), os.path.join(root, "imported")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "EP2" in out.stdout
    assert_same_canonical_state(os.path.join(root, "ours", "iter_0000002"), os.path.join(root, "imported"), 200)
    assert_read_in_place_as_imported(os.path.join(root, "native"), os.path.join(root, "imported"))

    out = subprocess.run(bcp + [os.path.join(root, "bare"), os.path.join(root, "bare_imported"), "--weights-only"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "--hf-config CONFIG_JSON" in out.stderr and "no run arguments" in out.stderr
    out = subprocess.run(bcp + [os.path.join(root, "bare"), os.path.join(root, "bare_imported"),
                                "--hf-config", os.path.join(root, "config.json")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    from ckpt_plugins._src.offline import open_checkpoint, read_tensor
    a_storage, a = open_checkpoint(os.path.join(root, "ours", "iter_0000002"))
    b_storage, b = open_checkpoint(os.path.join(root, "bare_imported"))
    weights = {k for k in a.tensors if k.startswith("model/")}
    assert weights == set(b.tensors) and len(weights) > 80
    for key in sorted(weights):
        assert torch.equal(read_tensor(a_storage, a, key), read_tensor(b_storage, b, key)), key


def test_megatron_consumed_samples_continue_the_same_stream_at_another_dp_size():
    """Megatron's own samplers, restarted from the consumed_samples a checkpoint restores (above, at
    another TP x PP x DP): the single sampler and the cyclic one without data sharding give every
    later global batch the uninterrupted run's samples at DP 2, 3 and 6; with data sharding the
    order depends on the DP size (the load warns)."""
    import megatron_shim
    megatron_shim.install()  # what Megatron needs on CPU (no triton)
    from megatron.training.datasets.data_samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler

    total, batch, consumed = 96, 12, 24

    def single(rank, dp, done):
        return MegatronPretrainingSampler(total, done, batch // dp, rank, dp)

    def cyclic(sharding):
        return lambda rank, dp, done: MegatronPretrainingRandomSampler(None, total, done, batch // dp, rank, dp,
                                                                       sharding)

    def global_batches(make, dp, done):
        ranks = [iter(make(r, dp, done)) for r in range(dp)]
        return [sorted(i for it in ranks for i in next(it)) for _ in range((total - done) // batch)]

    for make in (single, cyclic(False)):
        full = global_batches(make, 4, 0)
        for dp in (2, 3, 6):
            assert global_batches(make, dp, consumed) == full[consumed // batch:]
    sharded = cyclic(True)
    assert global_batches(sharded, 2, consumed) != global_batches(sharded, 4, 0)[consumed // batch:]


def test_the_run_arguments_are_stored_as_json_with_a_round_trip_only_for_what_is_not_a_plain_scalar(monkeypatch):
    import argparse
    import enum
    import json

    from megatron_ext import training

    class Signal(enum.Enum):
        TERM = 15
    args = {f"a{i}": v for i, v in enumerate([3, 0.5, "adam", None, True] * 100)}
    args.update(betas=(0.9, 0.95), nan=float("nan"), dtype=torch.bfloat16, signal=Signal.TERM, layers={"1": [2]})
    expected = {}
    for k, v in sorted(args.items()):
        try:
            expected[k] = json.loads(json.dumps(v, allow_nan=False))
        except (TypeError, ValueError):
            pass
    dumped, real = [], json.dumps
    monkeypatch.setattr(training.json, "dumps", lambda v, **k: dumped.append(v) or real(v, **k))
    values = training.RunState(7, 1.0, argparse.Namespace(**args)).values
    assert values["args"] == expected and list(values["args"]) == list(expected)
    assert len(dumped) == 5  # the tuple, the NaN, the dtype, the enum and the dict: no scalar
