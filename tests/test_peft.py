"""PEFT post-training: the base under its canonical names, adapters under their own
(`adapter/<name>/<weight>/<kind>`), adapter-only saves that refer to their base checkpoint, and the
tools (PEFT and merged exports, importing an adapter directory)."""
import os
import shutil

import pytest
import torch

import ckpt_plugins as cp
from bcp_cli import bcp
from ckpt_plugins._src.base_ref import BASE
from hf_models import tiny_llama



def lora(model, dora=False, **extra):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=dora,
                                            init_lora_weights=False, **extra))




def test_names_see_through_peft_both_ways(tmp_path):
    """A plain checkpoint fills a PEFT model's base (several adapters, DoRA, an adapted embedding,
    a module to save); the PEFT model's checkpoint gives a plain model its base, listing only the
    adapters as extra."""
    base = tiny_llama(0, tie=False)
    cp.save(tmp_path / "base", {"model": base})
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(tiny_llama(1, tie=False), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "embed_tokens"],
                                                                modules_to_save=["lm_head"], init_lora_weights=False))
    model.add_adapter("second", LoraConfig(r=2, target_modules=["q_proj"], use_dora=True, init_lora_weights=False))
    result = cp.load(tmp_path / "base", {"model": model}, strict=False)
    assert result.unexpected_keys == [] and all(k.startswith("model/adapter/") for k in result.missing_keys)
    inner = model.get_base_model()
    for name, p in base.state_dict().items():
        mine = {"lm_head.weight": inner.lm_head.original_module.weight,
                "model.embed_tokens.weight": inner.model.embed_tokens.base_layer.weight}.get(name)
        mine = mine if mine is not None else dict(inner.named_parameters()).get(
            name.replace("q_proj.weight", "q_proj.base_layer.weight").replace("v_proj.weight", "v_proj.base_layer.weight"))
        assert torch.equal(mine, p), name
    cp.save(tmp_path / "peft", {"model": model})
    stored = cp.read_metadata(tmp_path / "peft").tensors
    for key in ("model/model.layers.1.self_attn.q_proj.weight", "model/lm_head.weight",
                "model/adapter/default/model.layers.1.self_attn.q_proj.weight/lora_A",
                "model/adapter/second/model.layers.1.self_attn.q_proj.weight/lora_magnitude_vector",
                "model/adapter/default/model.embed_tokens.weight/lora_embedding_B",
                "model/adapter/default/lm_head.weight/modules_to_save"):
        assert key in stored, key
    plain = tiny_llama(2, tie=False)
    result = cp.load(tmp_path / "peft", {"model": plain}, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys
    assert all(k.startswith("model/adapter/") for k in result.unexpected_keys)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), base.state_dict().values()))


def lora_run(tmp_path):
    """A base checkpoint at `base`, and one LoRA step on it saved adapter-only at `run/lora`."""
    cp.save(tmp_path / "base", {"model": tiny_llama(0, tie=False)})
    model = lora(tiny_llama(1, tie=False))
    cp.load(tmp_path / "base", {"model": model}, strict=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    cp.save(tmp_path / "run" / "lora", {"model": model, "optim": opt}, base=tmp_path / "base")
    return model, opt


def test_adapter_only_save_refers_to_its_base_and_refuses_a_changed_one(tmp_path):
    model, opt = lora_run(tmp_path)
    stored = cp.read_metadata(tmp_path / "run" / "lora")
    assert {k.split("/")[1] for k in stored.tensors if k.startswith("model/")} == {"adapter"}  # no base weight
    assert stored.total_bytes < cp.read_metadata(tmp_path / "base").total_bytes / 4
    fresh = lora(tiny_llama(3, tie=False))
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    result = cp.load(tmp_path / "run" / "lora", {"model": fresh, "optim": fresh_opt})  # strict: base + adapters
    assert result.missing_keys == [] == result.unexpected_keys
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(opt.state.values(), fresh_opt.state.values()):
        assert torch.equal(p["exp_avg"], q["exp_avg"])
    # the reference is relative: the run and its base move together
    shutil.move(tmp_path / "run", tmp_path / "moved_run")
    shutil.move(tmp_path / "base", tmp_path / "base_elsewhere")
    new_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    with pytest.raises(cp.CheckpointError, match=r"saved on the base checkpoint .*base, which cannot be read"):
        cp.load(tmp_path / "moved_run" / "lora", {"model": fresh, "optim": new_opt})
    assert not new_opt.state  # the moments the load had created are dropped again
    cp.save(tmp_path / "base", {"model": tiny_llama(5, tie=False)})  # another base at the old place
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(cp.CheckpointError, match=r"lora was saved on the base checkpoint .*base, which has "
                                                 r"changed since .*Nothing was loaded"):
        cp.load(tmp_path / "moved_run" / "lora", {"model": fresh, "optim": fresh_opt})
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in before.items())  # nothing touched
    cp.save(tmp_path / "forged", {"model": tiny_llama(0, tie=False), "ckpt_plugins": {"base": "../elsewhere"}})
    with pytest.raises(cp.CheckpointError, match="malformed base reference '../elsewhere'"):
        cp.load(tmp_path / "forged", {"model": tiny_llama(0, tie=False)}, strict=False)


def sharded_worker(rank, world, root, framework):
    """LoRA over a frozen base under FSDP1 (use_orig_params: frozen and trained parameters share
    flat parameters) or DeepSpeed ZeRO-3: loads the one-process adapter-only checkpoint (base
    followed), trains a step and saves adapter-only on the same base."""
    model = lora(tiny_llama(7, tie=False))
    if framework == "fsdp1":
        import hf_ext  # noqa: F401  (FSDP1 handler)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        model = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        state = {"model": model, "optim": opt}
    else:
        import deepspeed_ext
        import ds_util
        from deepspeed_ext.engine import engine_state
        os.environ.setdefault("LOCAL_RANK", str(rank))
        ds_util.cpu_friendly_deepspeed()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        engine, *_ = deepspeed_ext.initialize(model=model, optimizer=opt, config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9})
        state = {k: v for k, v in engine_state(engine).items() if k in ("model", "optim")}
    cp.load(os.path.join(root, "run", "lora"), state)
    from checkpoint_compare import assert_matches
    assert_matches(os.path.join(root, "run", "lora"), state, under=("model/adapter/", "optim/"))
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(rank))
    if framework == "fsdp1":
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    else:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    cp.save(os.path.join(root, framework), state, base=os.path.join(root, "base"))


def test_lora_under_fsdp1_and_zero3_reshards_with_its_base(tmp_path):
    from distributed import run_ranks
    root = str(tmp_path)
    model, opt = lora_run(tmp_path)
    for framework in ("fsdp1", "ds_zero3"):
        os.environ.pop("LOCAL_RANK", None)
        run_ranks(2, sharded_worker, root, framework)
        meta = cp.read_metadata(tmp_path / framework)
        assert all(k.startswith("model/adapter/") for k in meta.tensors if k.startswith("model/")), framework
        back = lora(tiny_llama(2, tie=False))
        back_opt = torch.optim.AdamW([p for p in back.parameters() if p.requires_grad], lr=1e-2)
        cp.load(tmp_path / framework, {"model": back, "optim": back_opt})
        base = tiny_llama(0, tie=False).state_dict()
        inner = back.get_base_model()
        assert torch.equal(inner.model.layers[1].self_attn.q_proj.base_layer.weight,
                           base["model.layers.1.self_attn.q_proj.weight"])
        trained = dict(back.named_parameters())["base_model.model.model.layers.1.self_attn.q_proj.lora_B.default.weight"]
        assert not torch.equal(trained, dict(model.named_parameters())[
            "base_model.model.model.layers.1.self_attn.q_proj.lora_B.default.weight"])  # the step landed
        assert [float(s["step"]) for s in back_opt.state.values()] == [2.0] * 8, [float(s["step"]) for s in back_opt.state.values()]


def test_peft_export_of_a_dora_adapter_and_merging_refused(tmp_path):
    """A DoRA adapter exports in PEFT's format (its magnitude vectors included) and gives the
    model's logits through PeftModel.from_pretrained; merging it is refused with what to do."""
    from peft import PeftModel
    base = tiny_llama(0, tie=False)
    model = lora(tiny_llama(0, tie=False), dora=True).eval()
    cp.save(tmp_path / "ckpt", {"model": model})
    bcp("export", tmp_path / "ckpt", tmp_path / "adapter", "--format", "peft")
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    out = bcp("export", tmp_path / "ckpt", tmp_path / "merged", "--merge-adapters", check=False)
    assert out.returncode != 0 and "only plain LoRA adapters merge here" in out.stderr and "merge_and_unload" in out.stderr
    out = bcp("export", tmp_path / "ckpt", tmp_path / "x", "--format", "peft", "--adapter", "other", check=False)
    assert out.returncode != 0 and "no adapter 'other'" in out.stderr and "default" in out.stderr


def trainer_worker(rank, world, root, adapters_only, resume):
    from transformers import Trainer, TrainingArguments
    import hf_ext.trainer
    from test_hf_trainer import Tokens
    model = lora(tiny_llama(0))
    args = TrainingArguments(output_dir=os.path.join(root, "run"), per_device_train_batch_size=4, max_steps=4,
                             save_strategy="steps", save_steps=2, learning_rate=1e-2, use_cpu=True, report_to=[],
                             seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    hf_ext.trainer.enable(trainer, adapters_only=adapters_only)
    trainer.train(resume_from_checkpoint=resume)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               os.path.join(root, f"{adapters_only}_{resume is not None}.pt"))


def test_trainer_saves_a_peft_model_adapter_only_by_default(tmp_path):
    """With no base checkpoint given, the Trainer hook writes the frozen base once to
    `<output_dir>/base` and every checkpoint refers to it; resuming follows it.
    `adapters_only=False` stores everything."""
    from distributed import run_env_ranks
    root = str(tmp_path)
    run_env_ranks(1, trainer_worker, root, True, None)
    run = tmp_path / "run"
    assert sorted(os.listdir(run)) == ["base", "checkpoint-2", "checkpoint-4"]
    meta = cp.read_metadata(run / "checkpoint-2")
    assert BASE in meta.objects and not any(k.startswith("model/model.") for k in meta.tensors)
    shutil.rmtree(run / "checkpoint-4")
    run_env_ranks(1, trainer_worker, root, True, str(run / "checkpoint-2"))
    full, resumed = (torch.load(tmp_path / f"True_{r}.pt") for r in (False, True))
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    shutil.rmtree(run)
    run_env_ranks(1, trainer_worker, root, False, None)
    meta = cp.read_metadata(run / "checkpoint-2")
    assert "base" not in os.listdir(run) and BASE not in meta.objects
    assert "model/model.layers.0.self_attn.q_proj.weight" in meta.tensors
