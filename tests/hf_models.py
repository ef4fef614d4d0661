"""Tiny Llama models built from a config (no downloads), batches, and full-state snapshots that
compare across wrappers (plain, DDP, FSDP1, FSDP2) by canonical name."""
from __future__ import annotations

import torch
import torch.distributed as dist

VOCAB, SEQ = 96, 12


def tiny_llama(seed: int = 0, tie: bool = True, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, rms_norm_eps=1e-5)
    return LlamaForCausalLM(config).to(dtype)


def batch(step: int, rows: int = 6) -> torch.Tensor:
    """A global batch; 6 rows split evenly over 1, 2 or 3 ranks."""
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def local_rows(ids: torch.Tensor) -> torch.Tensor:
    """This rank's share of a global batch."""
    if not dist.is_initialized():
        return ids
    return ids[dist.get_rank()::dist.get_world_size()]


def train_step(model, opt, step: int) -> float:
    """One step on this rank's share of global batch `step`; returns the global batch's mean loss."""
    ids = local_rows(batch(step))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().reshape(1) * ids.shape[0]
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.item() / batch(step).shape[0]


def accelerate_step(accelerator, model, opt, sched, step: int) -> float:
    """One step through accelerate on this process's rows of global batch `step` (every n-th);
    returns the global batch's mean loss."""
    ids = batch(step)[accelerator.process_index::accelerator.num_processes]
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    return accelerator.gather(loss.detach().reshape(1)).mean().item()


def canonical(name: str) -> str:
    from ckpt_plugins._src.state import canonical_name
    return canonical_name(name.replace("module.", "", 1) if name.startswith("module.") else name)


def full_state(model, opt) -> dict:
    """Every parameter and optimizer state tensor, whole, by canonical name (collective when the
    model is sharded: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.tensor import DTensor
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    out = {f"p/{canonical(k)}": v.detach().clone() for k, v in msd.items()}
    for name, st in osd["state"].items():
        for k, v in st.items():
            v = v.full_tensor() if isinstance(v, DTensor) else v
            out[f"o/{canonical(name)}/{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def assert_same(ref: dict, got: dict) -> None:
    assert sorted(ref) == sorted(got), sorted(set(ref) ^ set(got))
    for k in ref:
        a, b = ref[k], got[k]
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (k, a.shape, b.shape, a.dtype, b.dtype)
        else:
            assert a == b, k
