"""Planning at scale, without processes: a 70B Llama-shaped job, TP8 x PP8 x DP.

For 1,024 and 8,192 ranks: time to build the global save plan (what the coordinator does) and a
rank's own load plan plus the global read-once assignment (what every rank does on load), the
metadata size, and peak memory. Targets: < 2 s and < 1 GiB at 8,192 ranks.

Run: .venv/bin/python bench/plan_scale.py
"""
from __future__ import annotations

import gc
import hashlib
import pickle
import resource
import time
import tracemalloc

from ckpt_plugins.plan import TensorSpec, assign_transfers, plan_load, plan_save, read_request

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 8192, 28672, 80, 64, 8, 32000
TP, PP = 8, 8


def rank_specs(tp: int, pp: int) -> list:
    """What one (tp, pp) rank holds: its TP shards of its PP stage's layers, weights + AdamW state."""
    head = HIDDEN // HEADS
    out = []

    def add(key, shape, dim):  # dim: the TP-split dimension, or None when replicated over TP
        offsets, lengths = [0] * len(shape), list(shape)
        if dim is not None:
            lengths[dim] = shape[dim] // TP
            offsets[dim] = tp * lengths[dim]
        for name, spec_key in (("weight", f"model/{key}"), ("exp_avg", f"optim/{key}/exp_avg"),
                               ("exp_avg_sq", f"optim/{key}/exp_avg_sq")):
            out.append(TensorSpec(spec_key, tuple(shape), "float32", tuple(offsets), tuple(lengths)))
        out.append(TensorSpec(f"optim/{key}/step", (), "float32", (), ()))

    per_stage = LAYERS // PP
    for layer in range(pp * per_stage, (pp + 1) * per_stage):
        p = f"model.layers.{layer}"
        add(f"{p}.self_attn.q_proj.weight", (HIDDEN, HIDDEN), 0)
        add(f"{p}.self_attn.k_proj.weight", (KV_HEADS * head, HIDDEN), 0)
        add(f"{p}.self_attn.v_proj.weight", (KV_HEADS * head, HIDDEN), 0)
        add(f"{p}.self_attn.o_proj.weight", (HIDDEN, HIDDEN), 1)
        add(f"{p}.mlp.gate_proj.weight", (FFN, HIDDEN), 0)
        add(f"{p}.mlp.up_proj.weight", (FFN, HIDDEN), 0)
        add(f"{p}.mlp.down_proj.weight", (HIDDEN, FFN), 1)
        add(f"{p}.input_layernorm.weight", (HIDDEN,), None)
        add(f"{p}.post_attention_layernorm.weight", (HIDDEN,), None)
    if pp == 0:
        add("model.embed_tokens.weight", (VOCAB, HIDDEN), 0)
    if pp == PP - 1:
        add("model.norm.weight", (HIDDEN,), None)
        add("lm_head.weight", (VOCAB, HIDDEN), 0)
    return out


def run(world: int) -> dict:
    dp = world // (TP * PP)
    templates = {(tp, pp): rank_specs(tp, pp) for tp in range(TP) for pp in range(PP)}
    digests = {c: hashlib.sha256(pickle.dumps(s)).digest() for c, s in templates.items()}
    # what the coordinator receives: one (specs, digest) per rank; rank = ((dp * PP) + pp) * TP + tp
    coords = [((r % TP), (r // TP) % PP) for r in range(world)]
    gathered = [list(templates[c]) for c in coords]
    rank_digests = [digests[c] for c in coords]

    def save_plan():
        return plan_save(gathered, files_per_rank=2, digests=rank_digests)

    def local_plans():  # what each rank does for itself, once per distinct layout here
        return {c: [read_request(r) for r in plan_load(plan.metadata, templates[c]).reads] for c in templates}

    def load_plan():  # the read-once assignment over every rank's requests (each rank runs it)
        return assign_transfers([requests[c] for c in coords], digests=rank_digests)

    t0 = time.perf_counter()
    plan = save_plan()
    t_save = time.perf_counter() - t0
    metadata_json = plan.metadata.to_json()
    t0 = time.perf_counter()
    requests = local_plans()
    t_local = (time.perf_counter() - t0) / len(templates)
    t0 = time.perf_counter()
    transfers = load_plan()
    t_load = t_local + time.perf_counter() - t0  # one rank's plan, then the global assignment
    # peak memory of each step, measured in a second, traced run (tracing slows it down)
    gc.collect()
    tracemalloc.start()
    save_plan()
    _, peak_save = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    load_plan()
    _, peak_load = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    read_once = sum(t.end - t.start for t in transfers.values())
    return dict(world=world, dp=dp, specs=sum(map(len, gathered)), boxes=sum(len(t.boxes) for t in plan.metadata.tensors.values()),
                t_save=t_save, balance=plan.balance, meta_mb=len(metadata_json) / 2**20,
                t_load=t_load, read_gb=read_once / 1e9, total_gb=plan.metadata.total_bytes / 1e9,
                peak_mb=max(peak_save, peak_load) / 2**20)


def main() -> None:
    print(f"70B Llama layout (hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}), TP{TP} x PP{PP} x DP, "
          "fp32 weights + AdamW state")
    print(f"{'ranks':>6} {'DP':>4} {'specs':>9} {'boxes':>7} {'save plan s':>11} {'balance':>8} "
          f"{'metadata MB':>11} {'load plan s':>11} {'read-once GB':>12} {'ckpt GB':>8} {'peak MB':>8}")
    for world in (1024, 8192):
        r = run(world)
        print(f"{r['world']:>6} {r['dp']:>4} {r['specs']:>9,} {r['boxes']:>7,} {r['t_save']:>11.2f} "
              f"{r['balance']:>8.3f} {r['meta_mb']:>11.1f} {r['t_load']:>11.2f} {r['read_gb']:>12.1f} "
              f"{r['total_gb']:>8.1f} {r['peak_mb']:>8.0f}")
        ok = r["t_save"] < 2 and r["t_load"] < 2 and r["peak_mb"] < 1024
        print(f"       target (< 2 s, < 1 GiB): {'met' if ok else 'MISSED'}")
    print(f"process max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
