"""One training run carried through four frameworks: Megatron TP2×PP2 (a Llama) or EP2×PP2 (a
Qwen3-MoE) with the distributed optimizer (2 steps) → DeepSpeed ZeRO-3 on 2 processes (2 steps) →
FSDP2 on 1 process (2 steps) → `bcp export` → transformers `from_pretrained`. Every step's loss
equals the uninterrupted run (one process, plain torch, the same initial weights and batches)
within TOLERANCE, the same for both models: the MoE routing picks the same experts everywhere.

TOLERANCE: the frameworks compute the same function in different summation orders (TP-split
matmuls, PP micro-batches, DP gradient averaging, ZeRO-3's reduce-scatter into flat partitions).
In fp32 that changes gradients by a few ulps, and Adam turns it into more: it divides each gradient
by its own running magnitude, so an element whose gradient is near zero (where a different sum
order changes it relatively most) gets an update of up to the learning rate either way. Measured
here, relative to the uninterrupted run: 3e-8 and 1e-7 on the Megatron steps, 0 on DeepSpeed's
first (identical state), 4.7e-6 after DeepSpeed's first update, 2.5e-6 and 4.4e-6 on FSDP2's.
Anything that failed to carry over (an Adam step count, a moment, a group's weight decay, the lr)
moves the next loss by 1e-3 or more.
"""
import json
import os

import pytest
import torch

import ckpt_plugins as cp
from bcp_cli import bcp
from distributed import run_ranks
from endpoints import build, close, hf_model
from test_round_trips import load

TOLERANCE = 2e-5  # relative: 4x the worst measured (4.7e-6)


def record(root, name, values):
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        with open(os.path.join(root, name + ".json"), "w") as f:
            json.dump(values, f)


def stage(rank, world, root, name, source, first_step, model, save_init=False):
    endpoint = build(name, 0 if source is None else 100 + first_step, model)
    if save_init:
        cp.save(os.path.join(root, "init"), {"model": endpoint.state["model"]})
    if source is not None:
        load(endpoint, os.path.join(root, source), source)
    losses = [endpoint.step(first_step + i) for i in range(2)]
    cp.save(os.path.join(root, name), endpoint.state)
    if name == "fsdp2":  # what the exported model must compute: the next batch's loss
        from endpoints import batch
        with torch.no_grad():
            ids = batch(6)
            losses.append(endpoint.model(input_ids=ids, labels=ids).loss.item())
    record(root, name, losses)
    close(endpoint)


def uninterrupted(rank, world, root, model):
    endpoint = build("single", 1, model)
    cp.load(os.path.join(root, "init"), {"model": endpoint.state["model"]})
    record(root, "reference", [endpoint.step(i) for i in range(6)])


@pytest.mark.parametrize("model, megatron", [("llama", "megatron_tp2pp2"), ("qwen3_moe", "megatron_ep2pp2")])
def test_megatron_to_deepspeed_to_fsdp2_to_hf_continues_the_same_run(tmp_path, model, megatron):
    root = str(tmp_path)
    run_ranks(4, stage, root, megatron, None, 0, model, True)
    run_ranks(2, stage, root, "ds_zero3", megatron, 2, model)
    run_ranks(1, stage, root, "fsdp2", "ds_zero3", 4, model)
    run_ranks(1, uninterrupted, root, model)
    bcp("export", os.path.join(root, "fsdp2"), tmp_path / "hf", "--format", "hf")
    hf_model(model, 0).config.save_pretrained(tmp_path / "hf")
    from transformers import AutoModelForCausalLM
    from endpoints import batch
    exported_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        ids = batch(6)
        exported = exported_model(input_ids=ids, labels=ids).loss.item()

    chain = []
    for name in (megatron, "ds_zero3", "fsdp2"):
        with open(tmp_path / f"{name}.json") as f:
            chain += json.load(f)
    with open(tmp_path / "reference.json") as f:
        reference = json.load(f)
    worst = max(abs(a - b) / abs(b) for a, b in zip(chain[:6], reference))
    print(f"chain vs uninterrupted: worst relative loss difference {worst:.2e} over 6 steps")
    print("per step", [f"{abs(a - b) / abs(b):.1e}" for a, b in zip(chain[:6], reference)])
    assert worst <= TOLERANCE, (chain, reference)
    assert exported == chain[6]  # the exported model is the FSDP2 job's model, exactly
