"""Checkpoints in other formats load in place through `cp.load`: HF safetensors directories
(sharded; block-quantized FP8) and PyTorch DCP checkpoints, resharded, each stored byte read
once; bad input is refused before anything is touched."""
import json
import os
import pickle
import struct

import pytest
import torch
import torch.distributed as dist

import ckpt_plugins as cp
from distributed import run_ranks
from hf_models import full_state, tiny_llama, train_step
from test_hf_moe import hf_moe

BLOCK = [8, 8]  # small blocks, so that tiny weights span several, edge blocks partial


# ---------------------------------------------------------------- fixtures


def hf_sharded_moe(root) -> str:
    """A Qwen3-MoE saved by transformers, in shards small enough that its tensors span several files."""
    path = os.path.join(root, "hf")
    hf_moe("qwen3_moe", 0).save_pretrained(path, max_shard_size="8KB")
    return path


def _quantized(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and (".self_attn." in name or ".mlp.experts." in name
                                                          or ".shared_experts." in name)


def fp8_deepseek(root) -> tuple:
    """A tiny DeepSeek-V3 in the layout DeepSeek ships: its linear weights float8_e4m3fn with a
    float32 `weight_scale_inv` per 8×8 block, two shards and an index, quantization_config in
    config.json. Returns the directory and the reference dequantization (bf16) by name."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(root, "fp8")
    model = hf_moe("deepseek_v3", 0).to(torch.bfloat16)
    model.save_pretrained(os.path.join(root, "bf16"))
    weights = load_file(os.path.join(root, "bf16", "model.safetensors"))
    files, reference = {}, {}
    for name, w in weights.items():
        if not _quantized(name, w):
            files[name], reference[name] = w, w
            continue
        rows, cols = -(-w.shape[0] // BLOCK[0]), -(-w.shape[1] // BLOCK[1])
        padded = torch.zeros(rows * BLOCK[0], cols * BLOCK[1])
        padded[:w.shape[0], :w.shape[1]] = w.float()
        blocks = padded.view(rows, BLOCK[0], cols, BLOCK[1])
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        q = (blocks / scale[:, None, :, None]).view_as(padded)[:w.shape[0], :w.shape[1]].to(torch.float8_e4m3fn)
        files[name], files[name + "_scale_inv"] = q, scale
        full = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:w.shape[0], :w.shape[1]]
        reference[name] = (q.float() * full).to(torch.bfloat16)
    os.makedirs(path)
    names = sorted(files)
    shards = [names[:len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: files[n].contiguous() for n in shard}, os.path.join(path, fname))
        weight_map.update((n, fname) for n in shard)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(root, "bf16", "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": BLOCK}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path, reference


def saved_as_hf(model, root) -> dict:
    """A live model's weights under the names its safetensors files use (transformers' writer)."""
    from safetensors.torch import load_file
    model.save_pretrained(root)
    return load_file(os.path.join(root, "model.safetensors"))


# ---------------------------------------------------------------- one process


def test_sharded_hf_moe_directory_loads_bit_for_bit_reading_each_byte_once(tmp_path):
    """transformers' own per-expert files, sharded, fill the fused experts of a fresh model as
    `from_pretrained` does; the load reads exactly the tensors' bytes, and says none of them had
    a checksum."""
    from transformers import AutoModelForCausalLM
    path = hf_sharded_moe(tmp_path)
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 3
    reference = AutoModelForCausalLM.from_pretrained(path)
    model = hf_moe("qwen3_moe", 1)
    result = cp.load(path, {"model": model})
    for (name, a), b in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    tensor_bytes = sum(t.nbytes for t in reference.state_dict().values())
    assert result.read_bytes == result.unverified_bytes == tensor_bytes
    assert cp.read_metadata(path).framework == "hf"


def test_fp8_block_quantized_directory_loads_dequantized(tmp_path):
    """Every FP8 weight arrives as weight × its block's scale_inv in float32, cast to the model's
    bf16, bit for bit; unquantized tensors as stored; the scales are not left over."""
    path, reference = fp8_deepseek(tmp_path)
    model = hf_moe("deepseek_v3", 1).to(torch.bfloat16)
    result = cp.load(path, {"model": model})
    assert result.unexpected_keys == [] and result.missing_keys == []
    got = saved_as_hf(model, tmp_path / "out")
    assert sorted(got) == sorted(reference)
    for name, ref in reference.items():
        assert torch.equal(got[name], ref), name
    # `bcp import-hf` reads it with the same reader: dequantized, scales consumed
    from ckpt_plugins._src.offline import open_checkpoint, read_tensor
    from hf_ext.safetensors_io import import_hf
    import_hf(path, tmp_path / "imported")
    storage, metadata = open_checkpoint(tmp_path / "imported")
    assert sorted(metadata.tensors) == sorted(f"model/{n}" for n in reference)
    for name, ref in reference.items():
        assert torch.equal(read_tensor(storage, metadata, f"model/{name}"), ref), name


def _to_torchtitan(name: str, t: torch.Tensor, heads: int, kv_heads: int) -> tuple:
    """An HF Llama tensor as torchtitan's Llama 3 stores it: its names, q/k rows in Meta's rotary
    order (torchtitan's `_reverse_permute`, written out here independently)."""
    import re
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m is None:
        return {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
                "lm_head.weight": "output.weight"}[name], t
    layer, rest = m.groups()
    titan = {"self_attn.q_proj.weight": "attention.wq.weight", "self_attn.k_proj.weight": "attention.wk.weight",
             "self_attn.v_proj.weight": "attention.wv.weight", "self_attn.o_proj.weight": "attention.wo.weight",
             "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.up_proj.weight": "feed_forward.w3.weight",
             "mlp.down_proj.weight": "feed_forward.w2.weight", "input_layernorm.weight": "attention_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight"}[rest]
    n = {"attention.wq.weight": heads, "attention.wk.weight": kv_heads}.get(titan)
    if n is not None:
        rows, cols = t.shape
        t = t.reshape(n, 2, rows // n // 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()
    return f"layers.{layer}.{titan}", t


def test_torchtitan_names_are_the_hf_family_names_its_adapters_give():
    """Old and fused-QKV names, Qwen3 norms, DeepSeek-V3 MLA and stacked experts (torchtitan's
    state-dict adapters' tables); only Llama 3 is stored rotary-permuted."""
    from hf_ext import torchtitan_names as tt
    assert tt.hf_name("layers.3.attention.qkv_linear.wk.weight") == "model.layers.3.self_attn.k_proj.weight"
    assert tt.hf_name("layers.3.attention.wk.weight") == "model.layers.3.self_attn.k_proj.weight"
    assert tt.hf_name("output.weight") == tt.hf_name("lm_head.weight") == "lm_head.weight"
    assert tt.hf_name("layers.0.attention.q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert tt.hf_name("layers.1.attention.wkv_a.weight") == "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert tt.hf_name("layers.1.moe.expert_bias_E") == "model.layers.1.mlp.gate.e_score_correction_bias"
    assert tt.stacked_hf_name("layers.2.moe.routed_experts.inner_experts.w2_EDF") == \
        "model.layers.2.mlp.experts.{}.down_proj.weight"
    assert tt.hf_name("layers.2.moe.routed_experts.inner_experts.w2_EDF") is None
    assert tt.rotary_permuted(["model.layers.0.self_attn.q_proj.weight"])
    assert not tt.rotary_permuted(["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_norm.weight"])
    assert tt.is_torchtitan(["tok_embeddings.weight"]) and not tt.is_torchtitan(["model.embed_tokens.weight"])


def test_a_torchtitan_llama_checkpoint_loads_into_an_hf_llama_with_equal_logits(tmp_path):
    """A DCP checkpoint named and laid out as torchtitan's Llama 3 (its q/k rows permuted per head,
    its optimizer state keyed by its own names) loads into transformers' Llama and AdamW: the
    same logits and moments as the model it was made from; without config.json beside it, a
    clear refusal."""
    import torch.distributed.checkpoint as dcp
    hf = tiny_llama(0, tie=False)
    config = hf.config
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    moments = {n: torch.randn_like(p) for n, p in hf.named_parameters()}
    state = {}
    for name, p in hf.state_dict().items():
        titan, value = _to_torchtitan(name, p, heads, kv)
        state[titan] = value
        state[f"optimizer.state.{titan}.exp_avg"] = _to_torchtitan(name, moments[name], heads, kv)[1]
        state[f"optimizer.state.{titan}.step"] = torch.tensor(3.0)
        state[f"optimizer.param_groups.{titan}.lr"] = 0.25
    state["train_state"] = {"step": 3}
    path = str(tmp_path / "titan")
    dcp.save(state, checkpoint_id=path, no_dist=True)
    model = tiny_llama(1, tie=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    with pytest.raises(cp.NotACheckpointError, match="config.json"):
        cp.load(path, {"model": model})
    config.to_json_file(os.path.join(path, "config.json"))
    result = cp.load(path, {"model": model, "optim": opt}, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == ["train_state.step"]
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, hf(ids).logits)
    for name, p in model.named_parameters():
        assert torch.equal(opt.state[p]["exp_avg"], moments[name]), name
        assert opt.state[p]["step"] == 3.0
    assert opt.param_groups[0]["lr"] == 0.25


def _dcp_job(rank, world, root):
    """An FSDP2 Llama with AdamW, 2 steps, then `dcp.save(get_state_dict(...))`; the full state and
    the next two steps' losses (the uninterrupted run) kept for the test. Also checked here: its
    checkpoint of ours exported to DCP loads into a fresh FSDP2 job through torch's own API."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    model = tiny_llama(0, tie=False)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        train_step(model, opt, step)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "dcp"))
    state = full_state(model, opt)

    # ours, out to DCP (`bcp export --format dcp --optimizer`), into a fresh FSDP2 job by torch alone
    cp.save(os.path.join(root, "ours"), {"model": model, "optim": opt})
    if rank == 0:
        from ckpt_plugins.ext import bcp
        assert bcp(["export", os.path.join(root, "ours"), os.path.join(root, "exported"), "--format", "dcp",
                    "--optimizer"]) == 0
    dist.barrier()
    fresh = tiny_llama(7, tie=False)
    for layer in fresh.model.layers:
        fully_shard(layer)
    fully_shard(fresh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    msd, osd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "exported"))
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    exported = full_state(fresh, fresh_opt)
    assert sorted(exported) == sorted(state)
    for key, value in state.items():
        assert torch.equal(exported[key], value) if isinstance(value, torch.Tensor) else exported[key] == value, key
    assert fresh_opt.param_groups[0]["lr"] == 1e-2

    losses = [train_step(model, opt, step) for step in (2, 3)]
    if rank == 0:
        torch.save({"state": state, "losses": losses}, os.path.join(root, "dcp_reference.pt"))


def _foreign_worker(rank, world, root, fp8_key):
    """The HF MoE directory into FSDP2 and the FP8 one row-sharded, on 2 ranks; then the DCP job."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    from transformers import AutoModelForCausalLM
    model = hf_moe("qwen3_moe", 1)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    result = cp.load(os.path.join(root, "hf"), {"model": model})
    reference = AutoModelForCausalLM.from_pretrained(os.path.join(root, "hf")).state_dict()
    for name, p in model.state_dict().items():
        assert torch.equal(p.full_tensor(), reference[name]), name
    read = torch.tensor([result.read_bytes])
    dist.all_reduce(read)
    assert read.item() == sum(t.nbytes for t in reference.values())  # each stored byte once, across ranks

    # a rank holding half the rows of a quantized weight reads those rows and its blocks' scales
    meta = cp.read_metadata(os.path.join(root, "fp8")).tensors
    shape = meta[f"model/{fp8_key}"].shape
    mesh = init_device_mesh("cpu", (world,))
    live = distribute_tensor(torch.zeros(shape, dtype=torch.bfloat16), mesh, [Shard(0)])
    result = cp.load(os.path.join(root, "fp8"), {"model": {fp8_key: live}}, strict=False)
    expected = torch.load(os.path.join(root, "fp8_reference.pt"))
    assert torch.equal(live.full_tensor(), expected)
    rows, scales = shape[0] // world, -(-shape[0] // BLOCK[0]) * -(-shape[1] // BLOCK[1]) * 4
    # its own rows of FP8 bytes, and scales (those of a block both need are read by one rank for both)
    assert rows * shape[1] <= result.read_bytes <= rows * shape[1] + scales
    read = torch.tensor([result.read_bytes])
    dist.all_reduce(read)
    assert read.item() == shape[0] * shape[1] + scales

    _dcp_job(rank, world, root)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """The 2-rank runs, once for the module: HF and FP8 loads checked there, a DCP job's output."""
    root = tmp_path_factory.mktemp("foreign")
    hf_sharded_moe(root)
    _, reference = fp8_deepseek(root)
    key = "model.layers.0.self_attn.q_b_proj.weight"
    assert reference[key].shape[0] % (2 * BLOCK[0]) != 0  # the ranks' rows share a block
    torch.save(reference[key], os.path.join(root, "fp8_reference.pt"))
    run_ranks(2, _foreign_worker, str(root), key)
    return root


def test_hf_directories_load_into_fsdp2_and_row_shards_reading_only_their_blocks(foreign):
    """(checked on the ranks: FSDP2 weights equal `from_pretrained`'s, bytes read once in all; an
    FP8 weight's row shards read their rows and their blocks' scales, each byte once in all)"""
    assert os.path.isdir(foreign / "dcp")


def test_dcp_of_an_fsdp2_job_loads_into_one_process_and_training_continues(foreign):
    """`dcp.save` of an FSDP2 job's `get_state_dict` loads into a plain model and AdamW on one
    process: weights and moments equal, param groups restored, the next steps' losses the
    uninterrupted run's."""
    ref = torch.load(foreign / "dcp_reference.pt")
    model = tiny_llama(1, tie=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    result = cp.load(foreign / "dcp", {"model": model, "optim": opt})
    assert result.missing_keys == [] and result.unexpected_keys == []
    got = full_state(model, opt)
    assert sorted(got) == sorted(ref["state"])
    for k, v in ref["state"].items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
    assert opt.param_groups[0]["lr"] == 1e-2
    losses = [train_step(model, opt, step) for step in (2, 3)]
    torch.testing.assert_close(losses, ref["losses"], rtol=1e-5, atol=0)


# ---------------------------------------------------------------- through the frameworks' own load paths


def _deepspeed_loads(rank, world, root):
    """DeepSpeed `engine.load_checkpoint(dir)` of the FSDP2 job's DCP checkpoint into ZeRO-2 (weights,
    moments, step and param groups; training continues), and of sharded HF MoE directories into
    ZeRO-3 and AutoEP EP2 with `load_module_only=True` (DeepSpeed's weights-only load)."""
    import deepspeed
    import ds_util
    from transformers import AutoModelForCausalLM
    ref = torch.load(os.path.join(root, "dcp_reference.pt"))
    eng = ds_util.engine(2, False, model=tiny_llama(5, tie=False))
    eng.load_checkpoint(os.path.join(root, "dcp"))
    got = ds_util.full_state(eng)
    for key, value in ref["state"].items():
        kind, name = key.split("/", 1)
        if kind == "p":
            assert torch.equal(got[f"w/{name}"], value) and torch.equal(got[f"m/{name}"], value), key
        elif not name.endswith("/step"):
            assert torch.equal(got[key], value), key
        else:
            assert torch.equal(got["step"], value), key
    assert got["lr"] == 1e-2
    losses = [ds_util.step(eng, step) for step in (2, 3)]
    assert losses[0] == ref["losses"][0]  # the loaded weights' loss, exactly
    # after a step: DeepSpeed reduces gradients in another order than FSDP2 (measured: 9e-5 relative)
    torch.testing.assert_close(losses[1], ref["losses"][1], rtol=1e-3, atol=0)

    model = hf_moe("qwen3_moe", 3)
    eng = ds_util.engine(3, False, model=model)
    eng.load_checkpoint(os.path.join(root, "hf"), load_module_only=True)
    reference = AutoModelForCausalLM.from_pretrained(os.path.join(root, "hf")).state_dict()
    for name, p in eng.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            assert torch.equal(p.detach(), reference[name]), name

    # AutoEP at EP2 (2 of the 4 experts per rank, regrouped by DeepSpeed): the experts it holds are
    # the files' per-expert tensors, as its own checkpoint of the loaded model shows
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "cross_framework"))
    import endpoints
    autoep = endpoints.build("ds_autoep2", 5, "qwen3_moe")
    autoep.engine.load_checkpoint(os.path.join(root, "hf_ep"), load_module_only=True)
    cp.save(os.path.join(root, "autoep_saved"), {"model": autoep.state["model"]})
    if rank == 0:
        from safetensors.torch import load_file
        from ckpt_plugins._src.offline import open_checkpoint, read_tensor
        files = {}
        for name in os.listdir(os.path.join(root, "hf_ep")):
            if name.endswith(".safetensors"):
                files.update(load_file(os.path.join(root, "hf_ep", name)))
        storage, meta = open_checkpoint(os.path.join(root, "autoep_saved"))
        assert sorted(meta.tensors) == sorted(f"model/{n}" for n in files)
        for name, value in files.items():
            assert torch.equal(read_tensor(storage, meta, f"model/{name}"), value), name
    endpoints.close(autoep)


def test_deepspeed_load_checkpoint_takes_dcp_and_hf_directories(foreign):
    import sys
    from distributed import run_env_ranks
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "cross_framework"))
    import endpoints
    endpoints.hf_model("qwen3_moe", 0).save_pretrained(foreign / "hf_ep", max_shard_size="20KB")
    run_env_ranks(2, _deepspeed_loads, str(foreign))


def test_accelerate_load_state_takes_a_dcp_checkpoint(foreign, caplog):
    """`accelerator.load_state(dcp_dir)`: the model and optimizer it holds, resharded into one
    process; what it lacks (scheduler, RNG, counters) named in a warning and left as is."""
    from accelerate import Accelerator

    import hf_ext.accelerate
    ref = torch.load(foreign / "dcp_reference.pt")
    accelerator = Accelerator(cpu=True)
    model = tiny_llama(3, tie=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    hf_ext.accelerate.enable(accelerator)
    accelerator.load_state(str(foreign / "dcp"))
    got = full_state(model, opt)
    assert all(torch.equal(got[k], v) for k, v in ref["state"].items())
    assert "holds no accelerator, rng, sched" in caplog.text


@pytest.mark.parametrize("how", ["init_from", "resume_from_checkpoint"])
def test_trainer_starts_from_a_dcp_checkpoint(foreign, tmp_path, how):
    """`enable(trainer, init_from=dcp_dir)`, or `train(resume_from_checkpoint=dcp_dir)`: a new run
    starts from the DCP job's weights and AdamW state, loaded into the prepared model, at step 0
    (the checkpoint has no trainer_state.json: nothing of the Trainer's to resume)."""
    from transformers import Trainer, TrainingArguments

    import hf_ext.trainer
    from test_hf_trainer import Tokens
    ref = torch.load(foreign / "dcp_reference.pt")
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=6, max_steps=1,
                             save_strategy="no", logging_steps=1, learning_rate=1e-2, use_cpu=True, report_to=[],
                             seed=0, disable_tqdm=True)
    trainer = Trainer(model=tiny_llama(4, tie=False), args=args, train_dataset=Tokens())
    hf_ext.trainer.enable(trainer, init_from=foreign / "dcp" if how == "init_from" else None)
    captured = {}
    original = trainer._prepare_for_training

    def prepare_and_capture(*args):
        out = original(*args)
        captured.update(full_state(trainer.model, trainer.optimizer))
        return out
    trainer._prepare_for_training = prepare_and_capture
    trainer.train(**({"resume_from_checkpoint": str(foreign / "dcp")} if how != "init_from" else {}))
    assert trainer.state.global_step == 1
    assert sorted(captured) == sorted(ref["state"])
    assert all(torch.equal(captured[k], v) for k, v in ref["state"].items())


# ---------------------------------------------------------------- bad input


def _tiny_hf(root) -> str:
    path = os.path.join(root, "hf")
    tiny_llama(0).save_pretrained(path)
    return path


def _rewrite_header(path: str, edit) -> None:
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _truncate(path):
    f = os.path.join(path, "model.safetensors")
    os.truncate(f, os.path.getsize(f) - 100)


def _overlap(path):
    def edit(header):
        a, b = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])[:2]
        size = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
        header[b]["data_offsets"] = [header[a]["data_offsets"][0], header[a]["data_offsets"][0] + size]
    _rewrite_header(os.path.join(path, "model.safetensors"), edit)


def _missing_shard(path):
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}, f)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _evil_dcp(path):
    os.makedirs(path)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Evil(), f)


@pytest.mark.parametrize("case,needle", [(_truncate, "does not fit"), (_overlap, "overlap"),
                                         (_missing_shard, "lacks"), (_evil_dcp, "posix.system is not allowed")])
def test_bad_foreign_input_is_refused_naming_it_and_nothing_changes(case, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if case is _evil_dcp:
        path = str(tmp_path / "dcp")
    else:
        path = _tiny_hf(tmp_path)
    case(path)
    model = tiny_llama(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(cp.CheckpointError, match=needle):
        cp.load(path, {"model": model})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not os.path.exists(tmp_path / "PWNED")


def test_a_foreign_tensor_that_does_not_fit_the_model_is_refused_before_any_read(tmp_path):
    path = _tiny_hf(tmp_path)
    model = tiny_llama(1)
    model.lm_head.weight = torch.nn.Parameter(torch.zeros(3, 3))  # untied, and the wrong shape
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(cp.LoadMismatchError, match="shape"):
        cp.load(path, {"model": model})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_model_only_checkpoint_into_a_job_with_an_optimizer_says_what_it_holds(tmp_path):
    """strict: the optimizer's state is named missing, and the message says the HF directory holds
    the model only and how to load it; nothing is touched. strict=False loads the model."""
    path = _tiny_hf(tmp_path)
    model = tiny_llama(1)
    opt = torch.optim.AdamW(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(cp.LoadMismatchError, match=r"optim/param_groups.*HF safetensors, read in place; it holds "
                                                    r"model only"):
        cp.load(path, {"model": model, "optim": opt})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    result = cp.load(path, {"model": model, "optim": opt}, strict=False)
    assert result.missing_keys == ["optim/param_groups"] and not opt.state
    assert all(torch.equal(a, b) for a, b in zip(tiny_llama(0).state_dict().values(), model.state_dict().values()))


def test_a_foreign_dtype_the_model_cannot_take_exactly_is_refused_and_a_widening_loads(tmp_path):
    """bf16 files into an fp16 model: refused before any read, naming both dtypes (a narrowing or
    lossy cast happens only when asked for); into an fp32 model: exact upcasts, as
    `from_pretrained(dtype=torch.float32)` gives."""
    path = os.path.join(tmp_path, "bf16")
    tiny_llama(0, dtype=torch.bfloat16).save_pretrained(path)
    model = tiny_llama(1, dtype=torch.float16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(cp.LoadMismatchError, match="wants float16.*bfloat16"):
        cp.load(path, {"model": model})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model = tiny_llama(1)
    cp.load(path, {"model": model})
    for a, b in zip(tiny_llama(0, dtype=torch.bfloat16).state_dict().values(), model.state_dict().values()):
        assert b.dtype == torch.float32 and torch.equal(a.float(), b)
