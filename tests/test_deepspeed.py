"""DeepSpeed ZeRO 0-3 (real engines, CPU, gloo) through deepspeed_ext: saved with 2 processes,
loaded with 1, 2 and 3, into the same and other stages and precisions; weights, fp32 masters,
Adam moments and step equal bit for bit (frozen parameters included), and training continues."""
import gc
import os
import traceback
import weakref

import pytest
import torch.distributed as dist
import torch

import ckpt_plugins as cp
from ckpt_plugins._src.storage import LocalStorage, storage_for
from ckpt_plugins._src.trace import load_telemetry
import ds_util
from distributed import exit_without_teardown, run_env_ranks

# (stage, bf16, fp32 gradient accumulation): stage 0 fp32 steps the torch optimizer directly, stage 0
# bf16 uses FP16_UnfusedOptimizer, stage 1 bf16 + fp32 accumulation BF16_Optimizer, the rest ZeRO 1-3
CONFIGS = [(0, False, False), (0, True, False), (1, False, False), (1, True, False), (1, True, True),
           (2, True, False), (3, False, False), (3, True, False)]


def name(stage, bf16, acc32=False):
    return f"z{stage}{'bf16' if bf16 else 'fp32'}{'acc32' if acc32 else ''}"


def save_all(rank, world, root):
    for stage, bf16, acc32 in CONFIGS:
        eng = ds_util.engine(stage, bf16, fp32_accumulation=acc32)
        for i in range(2):
            ds_util.step(eng, i)
        eng.save_checkpoint(os.path.join(root, name(stage, bf16, acc32)), client_state={"epoch": 3})
        ref = ds_util.full_state(eng)
        loss = ds_util.step(eng, 2)
        if rank == 0:
            torch.save({"state": ref, "loss": loss}, os.path.join(root, name(stage, bf16, acc32) + ".pt"))


def load(rank, world, root, cases):
    """cases: (saved config, loading config, exact loss expected)."""
    for (src_stage, src_bf16, src_acc32), (stage, bf16, acc32), exact in cases:
        eng = ds_util.engine(stage, bf16, seed=1, fp32_accumulation=acc32)
        path, client = eng.load_checkpoint(os.path.join(root, name(src_stage, src_bf16, src_acc32)))
        assert path.endswith("global_step2") and client == {"epoch": 3} and eng.global_steps == 2
        ref = torch.load(os.path.join(root, name(src_stage, src_bf16, src_acc32) + ".pt"))
        ds_util.assert_same_training_state(ref["state"], ds_util.full_state(eng), same_dtype=bf16 == src_bf16)
        loss = ds_util.step(eng, 2)
        if bf16 == src_bf16:  # (another precision computes another loss)
            if exact:
                assert loss == ref["loss"], (src_stage, stage, loss, ref["loss"])
            else:  # other world size or stage: gradients are summed in another order
                assert abs(loss - ref["loss"]) <= 2e-5 * abs(ref["loss"]), (src_stage, stage, loss, ref["loss"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    run_env_ranks(2, save_all, str(root))
    return str(root)


def test_bf16_weights_are_stored_as_their_fp32_masters_cast(saved):
    """Every stage in bf16 copies its masters into the weights after the step: the save stores
    the masters once and records the weights as their cast (the loads below check the bits);
    frozen parameters have no master and keep their weights."""
    for stage, bf16, acc32 in CONFIGS:
        meta = cp.read_metadata(os.path.join(saved, name(stage, bf16, acc32), "global_step2"))
        weights = {k for k in meta.tensors if k.startswith("model/")}
        mastered = {k for k in weights if f"optim/{k[6:]}/master" in meta.tensors}
        assert set(meta.casts) == mastered and (len(mastered) == len(weights) - 1 if bf16 else not mastered)
        assert not any(meta.tensors[k].boxes for k in mastered), name(stage, bf16, acc32)


def test_every_stage_reloads_on_one_process_in_any_stage_and_precision(saved):
    cases = [(c, c, False) for c in CONFIGS]
    cases += [((3, True, False), (1, True, False), False), ((1, False, False), (3, False, False), False),
              ((2, True, False), (0, True, False), False), ((2, True, False), (1, False, False), False),
              ((0, False, False), (3, True, False), False), ((1, True, True), (3, True, False), False)]
    run_env_ranks(1, load, saved, cases)


def test_every_stage_reloads_on_two_processes_and_crosses_stages(saved):
    cases = [(c, c, True) for c in CONFIGS]
    cases += [((3, True, False), (1, True, False), False), ((1, False, False), (3, False, False), False),
              ((2, True, False), (0, True, False), False)]
    run_env_ranks(2, load, saved, cases)


def test_two_to_three_processes(saved):
    run_env_ranks(3, load, saved, [((1, False, False), (1, False, False), False),
                                   ((3, True, False), (3, True, False), False),
                                   ((3, True, False), (2, True, False), False)])


def engine_semantics(rank, world, root):
    eng = ds_util.engine(1, True)
    ds_util.step(eng, 0)
    eng.save_checkpoint(root, client_state={"a": 1})  # tag global_step1
    ds_util.step(eng, 1)
    eng.save_checkpoint(root, client_state={"a": 2})  # tag global_step2 -> latest
    assert open(os.path.join(root, "latest")).read() == "global_step2"
    assert cp.read_metadata(os.path.join(root, "global_step2")).framework == "deepspeed"
    ref = ds_util.full_state(eng)

    fresh = ds_util.engine(1, True, seed=1)
    path, client = fresh.load_checkpoint(root, load_module_only=True)
    assert path.endswith("global_step2") and client == {"a": 2}
    got = ds_util.full_state(fresh)
    assert all(torch.equal(got[k], ref[k]) for k in ref if k.startswith(("w/", "m/")))  # weights, masters
    assert fresh.global_steps == 0 and not fresh.optimizer.optimizer.state  # nothing else
    path, _ = fresh.load_checkpoint(root, "global_step1", load_optimizer_states=False,
                                    load_lr_scheduler_states=False)
    assert fresh.global_steps == 1 and not fresh.optimizer.optimizer.state and fresh.lr_scheduler.last_epoch == 0
    fresh.load_checkpoint(root)
    ds_util.assert_same_training_state(ref, ds_util.full_state(fresh))
    assert fresh.lr_scheduler.last_epoch == eng.lr_scheduler.last_epoch == 2

    native = ds_util.engine(1, True, backend=False)  # without the config entry: DeepSpeed as before
    native.save_checkpoint(os.path.join(root, "native"), tag="t")
    assert not os.path.exists(os.path.join(root, "native", "t", "metadata.json"))
    fresh.load_checkpoint(os.path.join(root, "native"), "t")  # a native checkpoint still loads natively

    # DeepSpeedEngine.__del__ calls destroy, which waits for the last save: an engine left to the
    # collector (a ZeRO-0 one: ZeRO's gradient hooks keep theirs alive) and collected on the next
    # save's commit thread must not wait there for that commit
    gc.disable()
    doomed = ds_util.engine(0, False)
    gone, put = weakref.ref(doomed), LocalStorage.put_atomic
    del doomed
    LocalStorage.put_atomic = lambda self, *a: (gc.collect(), put(self, *a))[1]
    asynchronous = ds_util.engine(2, True, extra={"checkpoint": {"backend": "bytecheckpoint", "async": True,
                                                                 "overlap": False}})
    ds_util.step(asynchronous, 0)
    asynchronous.save_checkpoint(os.path.join(root, "async"))
    assert cp.checkpointer()._last._snapshot.is_set()  # "overlap": false: returned once the snapshot was taken
    try:
        cp.checkpointer()._last.wait(timeout=60)
    except TimeoutError:  # its commit thread, stuck for good, would keep this rank from exiting
        traceback.print_exc()
        os._exit(1)
    LocalStorage.put_atomic = put
    gc.enable()
    assert open(os.path.join(root, "async", "latest")).read() == "global_step1"
    assert rank != 0 or gone() is None  # the coordinator's commit thread collected it

    overlapped_saves_hold_the_step(rank, world, root)


def overlapped_saves_hold_the_step(rank, world, root):
    """"async" (overlapped by default): save_checkpoint returns before the snapshot, which here starts only once the
    optimizer's step has been called; the forward and backward passes between (ZeRO-3 gathering
    its parameters, a gradient accumulation micro-step) run beside it; the step waits for it.
    With a "host_memory" budget below the save, which then streams through it, compressed ("compress")."""
    import threading

    from faults import snapshots_held
    from hf_models import batch
    accumulate = {"train_micro_batch_size_per_gpu": ds_util.GLOBAL_ROWS // world, "gradient_accumulation_steps": 2,
                  "checkpoint": {"backend": "bytecheckpoint", "async": True, "host_memory": "64KiB",
                                 "compress": True}}
    eng = ds_util.engine(3, True, extra=accumulate)
    for micro in range(2):
        ds_util.step(eng, micro)
    ref = ds_util.full_state(eng)
    with snapshots_held() as go:
        eng.save_checkpoint(os.path.join(root, "overlap"))
        handle = cp.checkpointer()._last
        assert not handle._snapshot.is_set()
        for micro in range(2):
            ids = batch(2 + micro, ds_util.GLOBAL_ROWS)[rank::world].to(eng.device)
            eng.backward(eng(input_ids=ids, labels=ids).loss)
            if micro == 1:  # the boundary: the optimizer steps now
                threading.Timer(0.3, go.set).start()
            eng.step()
    info = handle.wait()
    # bigger than the budget: streamed through it, the snapshot waiting for the writes
    assert info.rank_bytes > 64 << 10 >= cp.checkpointer().pool.allocated_bytes > 0
    assert any(b.group for t in cp.read_metadata(handle.path).tensors.values() for b in t.boxes)
    after = ds_util.full_state(eng)
    assert not all(torch.equal(v, after[k]) for k, v in ref.items() if k.startswith("w/"))  # training went on
    fresh = ds_util.engine(3, True, seed=1, extra=accumulate)
    fresh.load_checkpoint(os.path.join(root, "overlap"))
    ds_util.assert_same_training_state(ref, ds_util.full_state(fresh))
    # engine.destroy() right after a save: committed first, as DeepSpeed's own decoupled checkpoint
    # engine commits at destroy, and before the optimizer's teardown under the snapshot
    with snapshots_held() as go:
        fresh.save_checkpoint(os.path.join(root, "destroyed"))
        handle = cp.checkpointer()._last
        threading.Timer(0.3, go.set).start()
        fresh.destroy()
        assert handle.done()
    again = ds_util.engine(3, True, seed=2, extra=accumulate)
    again.load_checkpoint(os.path.join(root, "destroyed"))
    ds_util.assert_same_training_state(ref, ds_util.full_state(again))
    bad = {**accumulate, "checkpoint": {**accumulate["checkpoint"], "compress": "fast"}}
    with pytest.raises(ValueError, match=r"compress must be True, False or 'auto', not 'fast'"):
        ds_util.engine(3, True, extra=bad)


def test_engine_checkpoint_semantics(tmp_path):
    run_env_ranks(2, engine_semantics, str(tmp_path))


def ds_to_fsdp2_and_back(rank, world, root):
    from torch.distributed.fsdp import fully_shard

    from hf_models import full_state as fsdp_full_state
    from hf_models import tiny_llama
    import deepspeed_ext
    from test_data_state import loader
    eng = ds_util.engine(2, True)
    data = cp.DataState(loader(rank, world, 3))  # the run's data position rides on the engine's checkpoints
    deepspeed_ext.add_state(eng, data=data)
    batches = iter(data)
    for i in range(2):
        next(batches)
        ds_util.step(eng, i)
    eng.save_checkpoint(root, tag="ds")
    upcoming = next(batches).tolist()
    ref = ds_util.full_state(eng)
    # the engine's first step warmed the first save up: plan cached, staging faulted in already
    for r in load_telemetry(storage_for(os.path.join(root, "ds")))["ranks"]:
        assert r.phase("plan").info["cached"] and r.phase("staging").bytes == 0, r
    model = tiny_llama(1)
    model.model.layers[0].input_layernorm.weight.requires_grad_(False)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    resumed = cp.DataState(loader(rank, world, 3))
    state = {"model": model, "optim": opt, "sched": cp.Ignore(), "engine": cp.Ignore(), "client_state": cp.Ignore(),
             "data": resumed}
    cp.load(os.path.join(root, "ds"), state)  # bf16 ZeRO-2 -> fp32 FSDP2: weights are the fp32 masters
    assert next(iter(resumed)).tolist() == upcoming  # the FSDP2 job goes on with the DeepSpeed run's data
    got = fsdp_full_state(model, opt)
    frozen = "model.layers.0.input_layernorm.weight"
    for key, value in ref.items():
        if key.startswith("m/"):  # the fp32 weights are DeepSpeed's fp32 masters
            assert torch.equal(got["p/" + key[2:]], value), key
        elif key.startswith("o/"):
            assert torch.equal(got[key], value), key
    assert torch.equal(got[f"p/{frozen}"], ref[f"w/{frozen}"].float())  # frozen: no master; bf16 widened
    assert all(torch.equal(got[f"o/{n}/step"], ref["step"]) for n in [k[2:] for k in ref if k.startswith("m/")])
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and opt.param_groups[0]["lr"] == ref["lr"]
    cp.save(os.path.join(root, "fsdp2"), {"model": model, "optim": opt})
    back = ds_util.engine(2, True, seed=2)
    back.load_checkpoint(root, "fsdp2", load_module_strict=False)  # FSDP2 saved no scheduler or counters
    ds_util.assert_same_training_state(ref, ds_util.full_state(back))


def test_deepspeed_checkpoint_moves_to_fsdp2_and_back(tmp_path):
    run_env_ranks(2, ds_to_fsdp2_and_back, str(tmp_path))


def trainer_run(rank, world, out_dir, resume, result_path):
    """The HF Trainer with a DeepSpeed ZeRO-3 bf16 config carrying the ckpt_plugins entry."""
    import deepspeed_ext
    ds_util.cpu_friendly_deepspeed()
    deepspeed_ext.install()  # the Trainer calls deepspeed.initialize itself
    from transformers import Trainer, TrainingArguments

    from hf_models import tiny_llama
    from test_hf_trainer import Tokens
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": "auto"},
              "checkpoint": {"backend": "bytecheckpoint"}}
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4 // world, max_steps=4,
                             save_strategy="steps", save_steps=2, logging_steps=1, learning_rate=1e-2,
                             use_cpu=True, bf16=True, report_to=[], seed=0, dataloader_drop_last=True,
                             deepspeed=config, disable_tqdm=True)
    trainer = Trainer(model=tiny_llama(0), args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=resume)
    assert trainer.model_wrapped._ckpt_plugins is not None  # the engine's checkpoints went through us
    if rank == 0:
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        torch.save({"losses": losses}, result_path)


def test_hf_trainer_with_deepspeed_resumes_on_another_process_count(tmp_path):
    import shutil
    run_env_ranks(2, trainer_run, str(tmp_path / "run"), None, tmp_path / "full.pt")
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert (ckpt / "latest").read_text() == "global_step2"
    meta = cp.read_metadata(ckpt / "global_step2")
    assert meta.framework == "deepspeed" and meta.layout["zero_stage"] == 3
    assert any(k.endswith("/master") for k in meta.tensors)  # bf16 weights and fp32 masters
    full = torch.load(tmp_path / "full.pt")["losses"]
    for world in (1, 2):
        out = tmp_path / f"resume{world}"
        shutil.copytree(ckpt, out / "checkpoint-2")
        run_env_ranks(world, trainer_run, str(out), str(out / "checkpoint-2"), tmp_path / f"r{world}.pt")
        resumed = torch.load(tmp_path / f"r{world}.pt")["losses"]
        print(f"resumed on {world} process(es): losses {resumed[3]}, {resumed[4]}; uninterrupted {full[3]}, {full[4]}")
        for step in (3, 4):
            if world == 2:
                assert resumed[step] == full[step], (step, resumed[step], full[step])
            else:  # another batch split sums in another order (measured: 6e-6 relative)
                assert abs(resumed[step] - full[step]) <= 1e-4 * abs(full[step]), (step, resumed[step], full[step])


def save_native(rank, world, root):
    for stage, bf16 in ((1, True), (2, False), (3, True)):
        eng = ds_util.engine(stage, bf16, backend=False)  # DeepSpeed's own format
        for i in range(2):
            ds_util.step(eng, i)
        eng.save_checkpoint(os.path.join(root, f"native{stage}"), client_state={"epoch": 5})
        ref = ds_util.full_state(eng)
        if rank == 0:
            torch.save(ref, os.path.join(root, f"native{stage}.pt"))
    exit_without_teardown()  # DeepSpeed's own gloo run, stock: see there


def load_imported(rank, world, root):
    for stage, bf16 in ((1, True), (2, False), (3, True)):
        eng = ds_util.engine(3 if stage < 3 else 1, bf16, seed=1)  # and into another stage
        path, client = eng.load_checkpoint(root, f"imported{stage}")
        assert client == {"epoch": 5} and eng.global_steps == 2
        ds_util.assert_same_training_state(torch.load(os.path.join(root, f"native{stage}.pt")),
                                           ds_util.full_state(eng))


def test_import_native_deepspeed_checkpoints(tmp_path):
    from bcp_cli import bcp
    run_env_ranks(2, save_native, str(tmp_path))
    for stage in (1, 2, 3):
        out = bcp("import-deepspeed", tmp_path / f"native{stage}", tmp_path / f"imported{stage}")
        assert f"ZeRO stage {stage}, 2 ranks" in out.stdout
    run_env_ranks(1, load_imported, str(tmp_path))
    from hf_models import tiny_llama, train_step
    model = tiny_llama(7)  # and into a plain fp32 HF model: the weights are the fp32 masters
    cp.load(tmp_path / "imported3", {"model": model, "optim": cp.Ignore(), "sched": cp.Ignore(),
                                     "engine": cp.Ignore(), "client_state": cp.Ignore()})
    ref = torch.load(tmp_path / "native3.pt")
    for name, p in model.named_parameters():
        expected = ref.get(f"m/{name}", ref[f"w/{name}"].float())
        assert torch.equal(p.detach(), expected), name
    # and the native directories themselves, read in place (their `latest` tag followed): weights and
    # Adam moments, each stored byte read once, no checksum to cover them
    for stage in (1, 2, 3):
        assert cp.checkpoint_format(tmp_path / f"native{stage}") == "DeepSpeed"
        ref = torch.load(tmp_path / f"native{stage}.pt")
        model = tiny_llama(7, dtype=torch.bfloat16 if stage != 2 else torch.float32)
        model.model.layers[0].input_layernorm.weight.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.5)
        result = cp.load(tmp_path / f"native{stage}", {"model": model, "optim": opt, "sched": cp.Ignore(),
                                                        "engine": cp.Ignore(), "client_state": cp.Ignore()},
                         strict=False)  # a bf16 run's fp32 masters have no place in a plain AdamW
        assert result.missing_keys == [] and all(k.endswith("/master") for k in result.unexpected_keys)
        assert result.unverified_bytes == result.read_bytes > 0
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), ref[f"w/{name}"]), (stage, name)
            if p.requires_grad:  # fp32 moments in a bf16 model's plain AdamW: cast, as its load_state_dict does
                assert torch.equal(opt.state[p]["exp_avg"], ref[f"o/{name}/exp_avg"].to(p.dtype)), (stage, name)
        assert opt.param_groups[0]["lr"] == ref["lr"]
        train_step(model, opt, 0)  # (torch's Adam refuses fp32 moments of bf16 parameters)


SPECIALS = torch.tensor([1, 0x7FC00001, -(1 << 31), 0x7F800001, 0x00000007], dtype=torch.int32)  # denormal, NaN
# payloads (quiet, signalling), -0.0, another denormal: values torch.equal cannot tell apart or calls unequal


def _flat_states(eng) -> list:
    """Every optimizer state tensor and master partition of this rank, flat, padding included."""
    base = eng.optimizer.optimizer
    masters = (getattr(eng.optimizer, "single_partition_of_fp32_groups", None)
               or getattr(eng.optimizer, "fp32_partitioned_groups_flat", None)
               or getattr(eng.optimizer, "fp32_groups_flat", None) or [])
    return [t for s in base.state.values() for _, t in sorted(s.items()) if torch.is_tensor(t) and t.dim() > 0] + list(masters)


def special_values(rank, world, root):
    """Denormals, NaN payloads and negative zeros in the Adam moments and fp32 masters come back
    bit for bit on every ZeRO stage, elastic or not; so does a partition's zero padding."""
    import torch.nn.functional as F

    import deepspeed_ext
    ds_util.cpu_friendly_deepspeed()

    def engine(stage, elastic, fused=False):
        torch.manual_seed(1)
        model = torch.nn.Linear(10, 10)  # 110 elements: each rank's partition ends in padding
        config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": stage, "elastic_checkpoint": elastic},
                  "zero_allow_untested_optimizer": True, "checkpoint": {"backend": "bytecheckpoint"}}
        opt = (ds_util.StandInFusedAdam if fused else torch.optim.Adam)(model.parameters(), lr=1e-3)
        return deepspeed_ext.initialize(model=model, optimizer=opt, config=config)[0]

    # (stage, elastic, a fused Adam: stage 0 then runs DeepSpeed's FP16_Optimizer)
    for stage, elastic, fused in ((1, True, False), (2, True, False), (2, False, False), (3, False, False),
                                  (0, False, True)):
        eng = engine(stage, elastic, fused)
        assert type(eng.optimizer).__name__ != "FP16_Optimizer" or fused
        for i in range(3):
            x = torch.randn(2, 10, generator=torch.Generator().manual_seed(10 * i + rank)).to(torch.bfloat16)
            eng.backward(F.cross_entropy(eng(x).float(), torch.tensor([i, i + 1])))
            eng.step()
        for t in _flat_states(eng):
            t.view(torch.int32)[:len(SPECIALS)] = SPECIALS
        saved = [t.clone() for t in _flat_states(eng)]
        path = os.path.join(root, f"z{stage}{elastic}")
        eng.save_checkpoint(path)
        fresh = engine(stage, elastic, fused)
        fresh.load_checkpoint(path)
        loaded = _flat_states(fresh)
        assert len(loaded) == len(saved)
        for a, b in zip(saved, loaded):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (stage, elastic, rank, a, b)


def test_every_bit_of_optimizer_state_survives_a_deepspeed_round_trip(tmp_path):
    run_env_ranks(2, special_values, str(tmp_path))


def bitsandbytes_partitions(rank, world, root):
    """bitsandbytes' 8-bit AdamW under ZeRO-1, 2 and 3 keeps, beside moments shaped like each
    rank's flat partition, an absmax per 256-element block of it: that comes back to the same
    partition bit for bit, and training goes on as if never stopped. Three processes (other
    partitions) are refused on every rank, naming the state, where a load once gave a rank another
    rank's blocks; so are parameters held whole, and a whole parameter's absmax into a partition."""
    import bitsandbytes as bnb
    import torch.nn.functional as F

    import deepspeed_ext
    ds_util.cpu_friendly_deepspeed()

    def engine(stage):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
                  "zero_allow_untested_optimizer": True, "checkpoint": {"backend": "bytecheckpoint"}}
        opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=0)
        return deepspeed_ext.initialize(model=model, optimizer=opt, config=config)[0]

    def train(eng, steps):
        for i in steps:
            x = torch.randn(2, 64, generator=torch.Generator().manual_seed(10 * i + rank)).to(torch.bfloat16)
            eng.backward(F.cross_entropy(eng(x).float(), torch.tensor([i % 8, (i + 1) % 8])))
            eng.step()
        return [p.detach().clone() for p in eng.module.parameters()]

    def plain():
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        return {"model": model, "optim": bnb.optim.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=0)}

    if world == 3:  # nor into parameters held whole, nor a whole parameter's absmax into a partition
        eng = engine(2)  # (DeepSpeed starts the process group)
        with pytest.raises(cp.LoadMismatchError, match="this job holds its parameters whole"):
            with open(os.path.join(root, "z2", "latest")) as f:
                cp.load(os.path.join(root, "z2", f.read().strip()), plain())
        whole = plain()
        whole["model"](torch.ones(2, 64)).sum().backward()
        whole["optim"].step()
        cp.save(os.path.join(root, "whole", "t"), whole)
        with pytest.raises(cp.LoadMismatchError, match="absmax1 is optimizer state shaped neither like its parameter"):
            eng.load_checkpoint(os.path.join(root, "whole"), tag="t")
    for stage in (1, 2, 3):
        path = os.path.join(root, f"z{stage}")
        if world == 3:
            with pytest.raises(cp.LoadMismatchError, match="absmax1 is optimizer state of one rank's partition"):
                engine(stage).load_checkpoint(path)
            continue
        eng = engine(stage)
        train(eng, range(3))
        eng.save_checkpoint(path)
        saved = [t.clone() for t in _flat_states(eng)]
        assert any(t.dtype == torch.uint8 for t in saved) and len(saved) > 4
        after = train(eng, range(3, 5))
        fresh = engine(stage)
        fresh.load_checkpoint(path)
        loaded = _flat_states(fresh)
        assert len(loaded) == len(saved)
        for a, b in zip(saved, loaded):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (stage, rank, a, b)
        assert all(torch.equal(a, b) for a, b in zip(after, train(fresh, range(3, 5)))), stage


def test_bitsandbytes_8bit_state_of_a_zero_partition_returns_to_that_partition(tmp_path):
    run_env_ranks(2, bitsandbytes_partitions, str(tmp_path))
    run_env_ranks(3, bitsandbytes_partitions, str(tmp_path))


def contract(rank, world, root, result_path):
    """What a DeepSpeed user sees around `save_checkpoint`/`load_checkpoint`, natively and with
    the plugin, per ZeRO stage (bf16): return values, the `latest` file, client_state, counters,
    what a resumed step computes, ZeRO-3's parameters after a save, and the flags."""
    import deepspeed
    ds_util.cpu_friendly_deepspeed()
    deepspeed.init_distributed()  # before the first engine: its batch size depends on the world size
    seen = {}
    for stage in (0, 1, 2, 3):
        for backend in (False, True):
            record = seen.setdefault((stage, backend), {})
            root_b = os.path.join(root, f"{'ours' if backend else 'native'}{stage}")
            eng = ds_util.engine(stage, True, backend=backend)
            for i in range(2):
                ds_util.step(eng, i)
            record["saved"] = eng.save_checkpoint(root_b, client_state={"epoch": 3})
            record["saved_tag"] = eng.save_checkpoint(root_b, tag="mine", client_state={"epoch": 4}, save_latest=False)
            if stage == 3:  # the parameters as DeepSpeed leaves them after its save (persistent ones gathered)
                record["status"] = [p.ds_status.name for p in eng.module.parameters()]
            if stage == 3 and backend:  # a save after a step leaves them as they are; one released is gathered again
                from deepspeed_ext.engine import settled
                persistent, after_step = eng.optimizer.persistent_parameters[0], settled(eng)
                persistent.partition()
                seen["settles"] = (after_step, settled(eng))
                eng.save_checkpoint(root_b, tag="again", save_latest=False)
                seen["settles"] += (persistent.ds_status.name, settled(eng))
            record["latest"] = open(os.path.join(root_b, "latest")).read()
            record["next_loss"] = ds_util.step(eng, 2)
            fresh = ds_util.engine(stage, True, seed=1, backend=backend)
            path, client = fresh.load_checkpoint(root_b)
            record["loaded"] = (_tag_of(path, root_b), client["epoch"], fresh.global_steps, fresh.global_samples,
                                fresh.skipped_steps, fresh.get_lr())
            record["resumed_loss"] = ds_util.step(fresh, 2)
            fresh.load_checkpoint(root_b)  # into a job that has stepped: ZeRO-3's persistent parameters are gathered
            record["reloaded_loss"] = ds_util.step(fresh, 2)
            path, client = fresh.load_checkpoint(root_b, tag="mine", load_module_only=True)
            record["module_only"] = (_tag_of(path, root_b), client["epoch"], fresh.global_steps)
            missing = ds_util.engine(stage, True, seed=1, backend=backend)
            record["no_latest"] = missing.load_checkpoint(os.path.join(root, "nothing-here"))
            dist.barrier()
    for backend in (False, True):  # DeepSpeed's tag validation: ranks naming different tags under "FAIL"
        checking = {"tag_validation": "FAIL", **({"backend": "bytecheckpoint"} if backend else {})}
        eng = ds_util.engine(1, True, backend=backend, extra={"checkpoint": checking})
        ds_util.step(eng, 0)
        root_b = os.path.join(root, f"tags-{backend}")
        record = seen.setdefault(("tags", backend), {"same": eng.save_checkpoint(root_b, tag="t")})
        try:
            eng.save_checkpoint(root_b, tag=f"t{rank}")
        except AssertionError as exc:
            record["different"] = str(exc)
        record["written"] = sorted(os.listdir(root_b))
        dist.barrier()
    if rank == 0:
        torch.save(seen, result_path)


def _tag_of(path: str, root: str) -> str:
    """The checkpoint a load returned: DeepSpeed returns the model-states file inside the tag's
    folder, the plugin the folder (a documented difference; both are None when nothing loads)."""
    return os.path.relpath(path, root).split(os.sep)[0]


def test_deepspeed_users_see_the_same_engine_with_the_plugin(tmp_path):
    run_env_ranks(2, contract, str(tmp_path), tmp_path / "seen.pt")
    seen = torch.load(tmp_path / "seen.pt")
    for stage in (0, 1, 2, 3):
        native, ours = seen[(stage, False)], seen[(stage, True)]
        assert ours == native, (stage, {k: (native[k], ours[k]) for k in native if native[k] != ours[k]})
        assert ours["resumed_loss"] == ours["reloaded_loss"] == ours["next_loss"]  # the uninterrupted step's
    assert seen["settles"] == (True, False, "AVAILABLE", True)
    native, ours = seen[("tags", False)], seen[("tags", True)]
    assert "is not consistent across all ranks" in native["different"] and ours == native, (native, ours)
    # the save directory's zero_to_fp32.py and zero_to_torch.py, run as DeepSpeed's users run them, give
    # DeepSpeed's weights
    import subprocess
    import sys
    from safetensors.torch import load_file
    for who in ("native2", "ours2"):  # (DeepSpeed's own refuses --safe_serialization with tied weights)
        out = subprocess.run([sys.executable, "zero_to_fp32.py", ".", str(tmp_path / f"{who}-fp32")],
                             cwd=tmp_path / who, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert os.access(tmp_path / who / "zero_to_torch.py", os.X_OK)
        out = subprocess.run([sys.executable, "zero_to_torch.py", ".", str(tmp_path / f"{who}-bf16"),
                              "--dtype", "bf16"], cwd=tmp_path / who, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    for dtype in ("fp32", "bf16"):
        native = torch.load(tmp_path / f"native2-{dtype}" / "pytorch_model.bin", weights_only=True)
        ours = load_file(tmp_path / f"ours2-{dtype}" / "model.safetensors")
        assert set(native) - set(ours) <= {"lm_head.weight"}  # ours leaves a tied copy to the embedding
        want = torch.float32 if dtype == "fp32" else torch.bfloat16
        assert all(v.dtype == want and torch.equal(v, native[k]) for k, v in ours.items())
