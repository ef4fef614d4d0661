"""HF model directories in and out (`bcp export`, `bcp import-hf`) and a plain accelerate loop."""
import json
import os
import subprocess
import sys

import torch

import ckpt_plugins as cp
from bcp_cli import bcp
from ckpt_plugins._src.storage import storage_for
from ckpt_plugins._src.trace import load_telemetry
from distributed import exit_without_teardown, run_env_ranks
from hf_models import accelerate_step, assert_same, batch, full_state, tiny_llama, train_step



def trained(seed=0, tie=True):
    model = tiny_llama(seed, tie=tie)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        train_step(model, opt, step)
    return model, opt


def test_export_loads_in_transformers_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM
    model, opt = trained()
    cp.save(tmp_path / "c", {"model": model, "optim": opt, "hf_config": model.config.to_json_string()})
    out = bcp("export", tmp_path / "c", tmp_path / "hf")
    assert "model.safetensors" in out.stdout and "config.json" in out.stdout
    ids = batch(9)
    expected = model(input_ids=ids).logits
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(loaded(input_ids=ids).logits, expected)
    bcp("export", tmp_path / "c", tmp_path / "sharded", "--max-shard-size", "20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "sharded")(input_ids=ids).logits, expected)


def test_export_prefers_fp32_masters_and_converts_on_request(tmp_path):
    from safetensors.torch import load_file
    model, _ = trained(tie=False)
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    low = tiny_llama(0, tie=False, dtype=torch.bfloat16)
    low.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    cp.save(tmp_path / "c", {"model": low, "optim": {n: {"master": m} for n, m in masters.items()}})
    bcp("export", tmp_path / "c", tmp_path / "bf16")
    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "bf16" / "model.safetensors").values())
    bcp("export", tmp_path / "c", tmp_path / "fp32", "--dtype", "float32")
    exported = load_file(tmp_path / "fp32" / "model.safetensors")
    assert all(torch.equal(exported[n], m) for n, m in masters.items())  # the masters, not upcast bf16


def test_export_of_a_plain_module_without_an_hf_config(tmp_path):
    from safetensors.torch import load_file
    model = torch.nn.Linear(4, 3)  # a Trainer checkpoint of a plain torch module has no HF config
    cp.save(tmp_path / "c", {"model": model, "hf_config": None})
    out = bcp("export", tmp_path / "c", tmp_path / "hf")
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors"] and "config.json" not in out.stdout
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in load_file(tmp_path / "hf" / "model.safetensors").items())


def test_export_streams_with_bounded_memory(tmp_path):
    tensors = {f"layer{i}.weight": torch.randn(2048, 3072) for i in range(8)}  # 8 x 24 MiB
    cp.save(tmp_path / "c", {"model": tensors})
    model_bytes = sum(t.numel() * 4 for t in tensors.values())
    del tensors

    def peak_kib(*args):
        code = ("import resource, sys; from ckpt_plugins.cli import main; main(sys.argv[1:]); "
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
        proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.strip().splitlines()[-1])

    baseline = peak_kib("inspect", tmp_path / "c")
    export = peak_kib("export", tmp_path / "c", tmp_path / "hf")
    extra = (export - baseline) * 1024
    print(f"export peak memory above baseline: {extra / 2**20:.0f} MiB for a {model_bytes / 2**20:.0f} MiB model")
    assert extra < 0.5 * model_bytes


def test_import_hf_loads_into_a_model(tmp_path):
    model, _ = trained(seed=3)
    model.save_pretrained(tmp_path / "hf")
    out = bcp("import-hf", tmp_path / "hf", tmp_path / "c")
    assert "wrote checkpoint" in out.stdout
    fresh = tiny_llama(4)
    cp.load(tmp_path / "c", {"model": fresh, "hf_config": cp.Ignore()})
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    untied = tiny_llama(4, tie=False)  # the tied lm_head is recorded as an alias of the embedding
    cp.load(tmp_path / "c", {"model": untied, "hf_config": cp.Ignore()})
    assert torch.equal(untied.lm_head.weight, model.model.embed_tokens.weight)
    again = bcp("import-hf", tmp_path / "hf", tmp_path / "c", check=False)
    assert again.returncode == 1 and "already holds a committed checkpoint" in again.stderr


def accelerate_run(rank, world, path, ref_path, resume):
    from accelerate import Accelerator

    import hf_ext.accelerate as hacc
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=f"{path}-tb")
    accelerator.init_trackers("run")
    model = tiny_llama(0 if not resume else 5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = accelerator.prepare(model, opt, sched)

    def step(i):  # returns the global batch's mean loss
        return accelerate_step(accelerator, model, opt, sched, i)

    from test_data_state import loader
    data = cp.DataState(loader(rank, world, 4 // world))  # a global batch of 4 on any process count

    def next_global_batch():
        everything = [None] * world
        torch.distributed.all_gather_object(everything, next(iter(data)).tolist())
        return sorted(i for part in everything for i in part)

    if not resume:
        step(0)
        hacc.warm_up(accelerator, extra={"data": data})
        step(1)
        next_global_batch()  # the data position is mid-epoch
        hacc.save_state(accelerator, path, step=2, extra={"data": data})
        upcoming = next_global_batch()
        for r in load_telemetry(storage_for(str(path)))["ranks"]:  # rank 0 holds every rank's record
            assert r.phase("plan").info["cached"] and r.phase("staging").bytes == 0, r  # warmed up
        ref = full_state(accelerator.unwrap_model(model), opt.optimizer)
        sched_state, counter = sched.state_dict(), accelerator.step
        loss = step(2)
        accelerator.end_training()
        if rank == 0:
            torch.save({"state": ref, "loss": loss, "sched": sched_state, "step": counter, "upcoming": upcoming},
                       ref_path)
        exit_without_teardown()
    hacc.load_state(accelerator, path, extra={"data": data})
    ref = torch.load(ref_path)
    assert_same(ref["state"], full_state(accelerator.unwrap_model(model), opt.optimizer))
    assert sched.state_dict() == ref["sched"]  # (accelerate steps it once per process: compare before stepping)
    assert accelerator.step == ref["step"]
    assert next_global_batch() == ref["upcoming"]  # the data position, resharded to this process count
    loss = step(2)
    assert abs(loss - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    accelerator.end_training()  # as accelerate asks of every script that tracks
    exit_without_teardown()  # see there: a fresh-clone CI run saw this rank abort in the interpreter's teardown


def test_accelerate_save_and_load_state_across_process_counts(tmp_path):
    from test_hf_trainer import tensorboard_scalars
    run_env_ranks(2, accelerate_run, tmp_path / "c", tmp_path / "ref.pt", False)
    # the save's figures reached accelerate's own tracker, at the saved step
    stalls = tensorboard_scalars(tmp_path / "c-tb", "ckpt/stall_s")
    assert list(stalls) == [2] and stalls[2] > 0
    run_env_ranks(1, accelerate_run, tmp_path / "c", tmp_path / "ref.pt", True)
    run_env_ranks(2, accelerate_run, tmp_path / "c", tmp_path / "ref.pt", True)
