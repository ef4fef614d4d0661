"""Planning at scale, without processes, for three layouts:
- a 70B Llama-shaped job, TP8 x PP8 x DP, fp32 weights + AdamW state (1,024 and 8,192 ranks;
  targets < 2 s and < 1 GiB at 8,192);
- DeepSeek-V3 671B (61 layers, the first 3 dense, 256 routed experts + 1 shared in 58 MoE layers,
  MLA), EP64 x PP16 x DP, bf16 weights and the distributed optimizer's fp32 masters and AdamW
  moments as flat ranges of each stage's dense buffer (over DP) and expert buffer (over
  expert-DP) (1,024 and 16,384 ranks; targets < 5 s save plan, < 1 s load plan, < 4 GiB and decoding
  < 0.5 s at 16,384);
- a Kimi-K2-shaped 1T MoE (DeepSeek-V3's shapes with 384 routed experts, the first layer dense, 64
  heads, a 163,840 vocabulary) at EP64 x PP16 x expert-DP, the same state (16,384 and 131,072 ranks;
  the same plan and memory targets at 131,072, and metadata < 150 MB; its decoding is reported).

Reported: the global save plan (what the coordinator does), the metadata's size, the time to
encode it (the commit, on one rank) and to decode it (every rank, once per load), beside the same
for format version 1's encoding; a rank's own load plan on the decoded metadata plus the global
read-once assignment (what every rank does on load); peak memory; the bytes of the
coordinator's collectives (`collectives`) and of a load's all-gathers, with the time to join
what they deliver (`load_exchange`). Checksums are random, as real ones are (a zero packs
smaller).

Run: .venv/bin/python bench/plan_scale.py [--layout llama70b|dsv3|kimik2] [--world N]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import pickle
import random
import resource
import sys
import time
import tracemalloc
from typing import Tuple

import torch

from ckpt_plugins._src.metadata_codec import decode_metadata, encode_metadata
from ckpt_plugins._src import packing
from ckpt_plugins._src.fragment import flat_views
from ckpt_plugins._src.gcpause import gc_paused
from ckpt_plugins._src.plan_cache import PlanReply, Structure, _request
from ckpt_plugins._src.load_request import ShareRequests, LoadRequest, LoadRequests, key_runs
from ckpt_plugins._src.loading import StoredKeys, file_table
from ckpt_plugins._src.saving import WriteReport
from ckpt_plugins._src.plan import TensorSpec, plan_load
from ckpt_plugins._src.runs import RunGroups, runs_of
from ckpt_plugins._src.save_plan import data_file_names, plan_save, spec_runs
from ckpt_plugins._src.save_request import PlanRequests, joined_runs, runs_message, shares_asked, stretches_asked
from ckpt_plugins._src.read_once import RankReads, assign_transfers, reads_share, read_request

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


def llama_layout(world: int):
    """(coordinates of each rank, spec lists per distinct coordinates)."""
    templates = {(tp, pp): rank_specs(tp, pp) for tp in range(TP) for pp in range(PP)}
    return [((r % TP), (r // TP) % PP) for r in range(world)], {c: (t,) for c, t in templates.items()}  # rank = ((dp * PP) + pp) * TP + tp


# DeepSeek-V3 671B and a Kimi-K2-shaped 1T: MLA, one shared expert, routed experts over EP
V3 = dict(hidden=7168, ffn=18432, moe_ffn=2048, layers=61, dense=3, experts=256, heads=128, q_lora=1536,
          kv_lora=512, nope=128, rope=64, v=128, vocab=129280)
K2 = dict(V3, dense=1, experts=384, heads=64, vocab=163840)
EP, PP = 64, 16
STAGES = [4] * 15 + [1]  # 61 layers over 16 stages (megatron's uneven first/last stage options)


def moe_stage(c: dict, pp: int):
    """(dense params, per-expert params) of a stage: (HF name, shape) in megatron's order."""
    first = sum(STAGES[:pp])
    dense, experts = [], []
    if pp == 0:
        dense.append(("model.embed_tokens.weight", (c["vocab"], c["hidden"])))
    for layer in range(first, first + STAGES[pp]):
        p = f"model.layers.{layer}."
        dense += [(p + "input_layernorm.weight", (c["hidden"],)),
                  (p + "self_attn.q_a_proj.weight", (c["q_lora"], c["hidden"])),
                  (p + "self_attn.q_a_layernorm.weight", (c["q_lora"],)),
                  (p + "self_attn.q_b_proj.weight", (c["heads"] * (c["nope"] + c["rope"]), c["q_lora"])),
                  (p + "self_attn.kv_a_proj_with_mqa.weight", (c["kv_lora"] + c["rope"], c["hidden"])),
                  (p + "self_attn.kv_a_layernorm.weight", (c["kv_lora"],)),
                  (p + "self_attn.kv_b_proj.weight", (c["heads"] * (c["nope"] + c["v"]), c["kv_lora"])),
                  (p + "self_attn.o_proj.weight", (c["hidden"], c["heads"] * c["v"])),
                  (p + "post_attention_layernorm.weight", (c["hidden"],))]
        if layer < c["dense"]:
            dense += [(p + f"mlp.{n}_proj.weight", s) for n, s in (("gate", (c["ffn"], c["hidden"])),
                                                                    ("up", (c["ffn"], c["hidden"])),
                                                                    ("down", (c["hidden"], c["ffn"])))]
            continue
        dense += [(p + "mlp.gate.weight", (c["experts"], c["hidden"])),
                  (p + "mlp.gate.e_score_correction_bias", (c["experts"],))]
        dense += [(p + f"mlp.shared_experts.{n}_proj.weight", s) for n, s in (
            ("gate", (c["moe_ffn"], c["hidden"])), ("up", (c["moe_ffn"], c["hidden"])), ("down", (c["hidden"], c["moe_ffn"])))]
        experts.append([(p + "mlp.experts.{e}." + f"{n}_proj.weight", s) for n, s in (
            ("gate", (c["moe_ffn"], c["hidden"])), ("up", (c["moe_ffn"], c["hidden"])), ("down", (c["hidden"], c["moe_ffn"])))])
    if pp == PP - 1:
        dense += [("model.norm.weight", (c["hidden"],)), ("lm_head.weight", (c["vocab"], c["hidden"]))]
    return dense, experts


def sharded_state(params, shard: int, shards: int) -> list:
    """The distributed optimizer's fp32 master and moments of shard `shard` of the bucket that packs
    `params` (reverse order): flat ranges of each parameter, as boxes."""
    sizes = [math.prod(shape) for _, shape in params]
    total = sum(sizes)
    lo, hi = total * shard // shards, total * (shard + 1) // shards
    out, at = [], 0
    for (key, shape), n in zip(reversed(params), reversed(sizes)):
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            for (offsets, lengths), _ in flat_views(shape, a - at, b - a):
                out += [TensorSpec(f"optim/{key}/{s}", tuple(shape), "float32", tuple(offsets), tuple(lengths))
                        for s in ("master", "exp_avg", "exp_avg_sq")]
        at += n
    return out


def moe_layout(c: dict):
    def layout(world: int):
        """Megatron's order with TP1: rank = pp * DP + dp; EP inside DP (ep = dp % EP). A rank's
        specs are its weights, those of its (stage, expert group) and the same list on its
        replicas, then its optimizer shards."""
        dp = world // PP
        stages = [moe_stage(c, pp) for pp in range(PP)]
        local = c["experts"] // EP
        weights, templates, coords = {}, {}, []
        for rank in range(world):
            pp, d = divmod(rank, dp)
            ep, edp = d % EP, d // EP
            coords.append((pp, d))
            dense, experts = stages[pp]
            mine = [(name.format(e=ep * local + i), shape) for layer in experts for i in range(local) for name, shape in layer]
            if (pp, ep) not in weights:
                weights[pp, ep] = [TensorSpec(f"model/{k}", tuple(s), "bfloat16", (0,) * len(s), tuple(s))
                                   for k, s in dense + mine]
            templates[(pp, d)] = (weights[pp, ep], sharded_state(dense, d, dp) + sharded_state(mine, edp, dp // EP))
        return coords, templates
    return layout


FILES_PER_RANK = 2
LINK_GBS = 10  # the coordinator's network, for the collectives' times
V1_MAX_WORLD = 16384  # format version 1, compared up to here (beyond, its JSON alone takes several GB)
# layout, rank counts, targets at the largest: save plan s, load plan s, planner peak MB, metadata MB, and
# the metadata's decoding on every rank of a load, s (set for DeepSeek-V3 at 16,384 ranks; Kimi-K2's
# at 131,072 is printed beside its other targets, not held to it)
LAYOUTS = {"llama70b": (llama_layout, (1024, 8192), (2.0, 2.0, 1024, None, 0.5)),
           "dsv3": (moe_layout(V3), (1024, 16384), (5.0, 1.0, 4096, None, 0.5)),
           "kimik2": (moe_layout(K2), (16384, 131072), (5.0, 1.0, 4096, 150, None))}


def link_s(mb: float) -> float:
    return mb * 2**20 / (LINK_GBS * 1e9)


def version_1(metadata) -> bytes:
    """The metadata as format version 1 wrote it (a JSON object per tensor and box), to compare."""
    body = dataclasses.asdict(dataclasses.replace(metadata, version=1))
    return json.dumps({"format": "ckpt_plugins", "version": 1, **body}, separators=(",", ":")).encode()


def plan_requests(gathered, rank_runs) -> Tuple[bytearray, list, bytearray]:
    """What the coordinator gathers and answers for a new save plan, as the collectives deliver it
    (`Coordinator.gather_bytes`, `scatter`): the ranks' run digests, its answers (`shares_asked`),
    then each distinct run's specs in shares from its holders (`plan_cache`)."""
    digests = [runs_message(runs) for runs in rank_runs]
    asked = shares_asked(joined_runs(delivered(digests, "run digests")))
    return packing.gathered(digests), [pickle.dumps(a) for a in asked], packing.gathered(
        [_request(Structure(specs, {}, []), stretches_asked(a)).packed() for specs, a in zip(gathered, asked)])


def delivered(blobs, what: str) -> packing.Joined:
    return packing.Joined.gathered(packing.gathered(blobs), len(blobs), what)


def joined_requests(digests: bytearray, requests: bytearray, world: int) -> Tuple[PlanRequests, RunGroups]:
    """What the coordinator makes of what it gathers: the runs grouped, its answer to each rank
    (`shares_asked`, packed as `scatter` sends it), the requests joined: `plan_save`'s input."""
    groups = joined_runs(packing.Joined.gathered(digests, world, "run digests"))
    packing.gathered([pickle.dumps(a) for a in shares_asked(groups)])
    return PlanRequests.of(packing.Joined.gathered(requests, world, "a plan request")), groups


def sizes(buffer: bytearray, world: int) -> int:
    """The bytes the ranks sent into a gathered buffer (`len(buffer)`: what it moved, padded)."""
    return int(packing.unframed(buffer, world)[1].sum())


def collectives(gathered, rank_runs, plan, digests, answers, requests) -> dict:
    """What the coordinator receives and sends: `plan_requests` received (their sum, and padded to
    the largest as gathered), beside the gather of every rank's whole spec list it replaces (as
    pickled); its answers and the plan's replies, with the time to make and pack the replies; the
    commit's gather of each rank's checksums and file sizes (pickled)."""
    world = len(gathered)
    t0 = time.perf_counter()
    replies = packing.gathered([pickle.dumps(PlanReply(None, plan.packed(rank), [], plan.balance, plan.chunk_bytes))
                                for rank in range(world)])
    t_send = time.perf_counter() - t0
    flat, reply, commit = 0, sizes(replies, world) + sum(map(len, answers)), 0
    del replies
    for rank, (specs, runs) in enumerate(zip(gathered, rank_runs)):
        flat += len(pickle.dumps((Structure(specs, {}, []), runs)))
        files = {f: plan.metadata.files[f] for f in data_file_names(rank, FILES_PER_RANK) if f in plan.metadata.files}
        commit += len(pickle.dumps(WriteReport(None, [e.crc32c for e in plan.stored[rank]], {}, files)))
    return dict(gather_flat_mb=flat / 2**20, gather_mb=(sizes(digests, world) + sizes(requests, world)) / 2**20,
                gather_padded_mb=(len(digests) + len(requests)) / 2**20,
                send_mb=reply / 2**20, t_send=t_send, commit_mb=commit / 2**20)


def torch_receiving(blobs) -> float:
    """A rank's time to take apart what `torch.distributed.all_gather_object` delivers of `blobs`
    (each pickled), after the collective, as torch's own code does: a tensor view per rank for
    the sizes and for the data, then each rank's object rebuilt (`_tensor_to_object`)."""
    from torch.distributed.distributed_c10d import _tensor_to_object
    pickled = [pickle.dumps(b) for b in blobs]
    longest = max(map(len, pickled))
    sizes, data = torch.tensor([len(p) for p in pickled]), torch.zeros(longest * len(blobs), dtype=torch.uint8)
    for i, p in enumerate(pickled):
        data[i * longest:i * longest + len(p)] = torch.frombuffer(bytearray(p), dtype=torch.uint8)
    t0 = time.perf_counter()
    size_views = [sizes[i].unsqueeze(dim=0) for i in range(len(blobs))]
    int(max(size_views).item())
    views = [data[longest * i:longest * (i + 1)] for i in range(len(blobs))]
    [_tensor_to_object(v.type(torch.uint8), n, None) for v, n in zip(views, size_views)]
    return time.perf_counter() - t0


@gc_paused  # as a load is (`loading.load`): its many small objects would have collections scan this heap
def load_exchange(requests, wanted, shares) -> Tuple[RankReads, RunGroups, dict]:
    """What a load's ranks all-gather before the read-once assignment, as the collective delivers
    it (`Coordinator.all_gather_bytes`: every message padded to the largest, in one buffer), and a
    rank's time to join it: first every rank's `LoadRequest` (its request runs, and the runs of
    the stored keys it uses: `wanted`, its specs' here), then each its `ShareRequests` (its share of
    the requests and keys of its runs), both `packed`; beside every rank's whole requests, which
    the second replaces. Returns the assignment's input: the joined requests and every rank's
    runs, grouped."""
    world = len(requests)
    blobs = [LoadRequest(wanted=w, key_runs=k, runs=r, host=f"host-{rank // 8}", path="ckpt").packed()
             for rank, ((w, k), (_, r)) in enumerate(zip(wanted, requests))]
    t_torch = torch_receiving(blobs)
    first = packing.gathered(blobs)
    t0 = time.perf_counter()
    every = LoadRequests.of(packing.Joined.gathered(first, world, "a load request"))
    t_first = time.perf_counter() - t0
    flat = sum(len(reads.packed()) for reads, _ in requests)
    blobs = [ShareRequests(w[0][every.key_runs.share(rank)], r).packed() for rank, (w, r) in enumerate(zip(wanted, shares(every.runs)))]
    t_torch += torch_receiving(blobs)
    second = packing.gathered(blobs)
    del blobs
    t0 = time.perf_counter()
    joined = ShareRequests.of(packing.Joined.gathered(second, world, "read requests"), every)
    t_second = time.perf_counter() - t0
    return joined.reads, every.runs, dict(load_request_mb=sizes(first, world) / 2**20, t_load_request=t_first,
                                          load_gather_mb=sizes(second, world) / 2**20, load_flat_mb=flat / 2**20,
                                          load_padded_mb=len(second) / 2**20, t_load_join=t_second,
                                          t_load_torch=t_torch)


def run(layout, world: int) -> dict:
    began = time.perf_counter()

    def stage(name):  # progress, on stderr: the largest layouts take many minutes
        print(f"  {world} ranks, {time.perf_counter() - began:6.0f} s: {name}", file=sys.stderr, flush=True)

    coords, parts = layout(world)  # a rank's specs: the concatenation of its parts (shared where alike)
    templates = {c: [s for part in p for s in part] for c, p in parts.items()}
    runs = {c: spec_runs(s) for c, s in templates.items()}  # each rank computes its own
    # what the coordinator receives: one (specs, runs) per rank
    gathered = [templates[c] for c in coords]
    rank_runs = [runs[c] for c in coords]

    sent = plan_requests(gathered, rank_runs)

    def save_plan(requests, groups):
        return plan_save(requests.specs, groups, files_per_rank=FILES_PER_RANK)

    @gc_paused  # as a load is
    def local_plan(c, metadata):  # what one rank does for itself: its reads and their runs, the keys it uses
        reads = plan_load(metadata, templates[c]).reads
        requests = [read_request(r) for r in reads]
        used(templates[c], StoredKeys.of(metadata))
        return RankReads.of(requests, file_table(metadata)[1]), runs_of([r.key for r in reads], requests)

    def used(specs, keys):  # the keys a rank uses and their runs, as its LoadRequest sends them (its specs')
        wanted = keys.of_keys({s.key for s in specs})
        return wanted, key_runs(keys.names, wanted)

    part_plans = {}

    def local_plan_by_parts(c, metadata, table):
        """The same, a part at a time: replicas share theirs. Equal to `local_plan` when each part
        holds whole runs (one top-level key per part, as the layouts' parts do)."""
        mine = []
        for part in parts[c]:
            if id(part) not in part_plans:
                reads = plan_load(metadata, part).reads
                requests = [read_request(r) for r in reads]
                part_plans[id(part)] = RankReads.of(requests, table), runs_of([r.key for r in reads], requests)
            mine.append(part_plans[id(part)])
        return RankReads.joined([m[0] for m in mine]), [r for m in mine for r in m[1]]

    def load_plan(rank=None):  # the read-once assignment over what every rank sent (each rank runs it), as on a
        # shared filesystem, where every rank can read every file (`Storage.restricted`)
        return assign_transfers(sent_reads, sent_runs, files, rank)

    stage("save plan")
    t0 = time.perf_counter()
    joined, groups = joined_requests(sent[0], sent[2], world)
    t_gather = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = save_plan(joined, groups)
    t_save = time.perf_counter() - t0
    rnd = random.Random(0)
    for meta in plan.metadata.tensors.values():  # checksums as the commit fills them in
        for box in meta.boxes:
            box.crc32c = [rnd.getrandbits(32) for _ in range(max(1, math.ceil(box.nbytes / plan.metadata.chunk_bytes)))]
    stage("metadata")
    t0 = time.perf_counter()
    encoded = encode_metadata(plan.metadata)
    t_encode = time.perf_counter() - t0
    t0 = time.perf_counter()
    decoded = decode_metadata(encoded)
    t_parse = time.perf_counter() - t0
    t0 = time.perf_counter()
    local_plan(coords[-1], decoded)  # builds the entries it uses
    t_local = time.perf_counter() - t0  # one rank (the last stage's: the biggest)
    t_encode_v1 = v1_mb = t_parse_v1 = math.nan
    if world <= V1_MAX_WORLD:
        t0 = time.perf_counter()
        v1 = version_1(plan.metadata)
        t_encode_v1, v1_mb = time.perf_counter() - t0, len(v1) / 2**20
        t0 = time.perf_counter()
        decode_metadata(v1)
        t_parse_v1 = time.perf_counter() - t0
        del v1
    files = list(decoded.files)
    table = {f: i for i, f in enumerate(files)}
    (whole, whole_runs), (by_parts, by_parts_runs) = local_plan(coords[-1], decoded), local_plan_by_parts(
        coords[-1], decoded, table)
    assert whole_runs == by_parts_runs and [whole.request(i, files) for i in range(len(whole))] == [
        by_parts.request(i, files) for i in range(len(by_parts))]
    stage("every rank's load plan")
    requests = {c: local_plan_by_parts(c, decoded, table) for c in templates}
    part_plans.clear()
    stage("read-once exchange")
    keys = StoredKeys.of(decoded)
    wanted = {c: used(specs, keys) for c, specs in templates.items()}
    sent_reads, sent_runs, exchange = load_exchange([requests[c] for c in coords], [wanted[c] for c in coords], lambda groups: (
        reads_share(requests[c][0], groups, rank) for rank, c in enumerate(coords)))
    del keys, wanted
    stage("read-once assignment")
    t0 = time.perf_counter()
    load_plan(world - 1)
    t_load = t_local + time.perf_counter() - t0  # one rank's plan, then the global assignment
    transfers = load_plan().transfers
    # peak memory of each step, measured in a second, traced run (tracing slows it down)
    stage("peak memory")
    gc.collect()
    tracemalloc.start()
    save_plan(joined, groups)
    _, peak_save = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    load_plan(world - 1)
    _, peak_load = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    read_once = sum(t.end - t.start for t in transfers.values())
    stage("collectives")
    sizes = collectives(gathered, rank_runs, plan, *sent)
    return dict(world=world, specs=sum(map(len, gathered)), boxes=sum(len(t.boxes) for t in plan.metadata.tensors.values()),
                t_save=t_save, t_gather=t_gather, balance=plan.balance, meta_mb=len(encoded) / 2**20, t_encode=t_encode, t_parse=t_parse,
                meta_v1_mb=v1_mb, t_encode_v1=t_encode_v1, t_parse_v1=t_parse_v1,
                t_load=t_load, read_gb=read_once / 1e9, total_gb=plan.metadata.total_bytes / 1e9,
                peak_mb=max(peak_save, peak_load) / 2**20, **sizes, **exchange)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), action="append")
    parser.add_argument("--world", type=int, action="append", help="rank counts (default: the layout's two)")
    args = parser.parse_args()
    for name in args.layout or sorted(LAYOUTS, reverse=True):
        layout, worlds, (save_s, load_s, peak_mb, meta_mb, decode_s) = LAYOUTS[name]
        print(f"{name}: save plan < {save_s:g} s, load plan < {load_s:g} s"
              + (f", decode < {decode_s:g} s" if decode_s else "") + f", peak < {peak_mb:,} MB"
              + (f", metadata < {meta_mb:g} MB" if meta_mb else "") + f" at {worlds[-1]:,} ranks")
        print(f"{'ranks':>6} {'specs':>10} {'boxes':>9} {'save plan s':>11} {'balance':>8} {'metadata MB':>11} "
              f"{'encode s':>8} {'decode s':>8} {'load plan s':>11} {'read-once GB':>12} {'ckpt GB':>8} {'peak MB':>8} "
              f"{'v1 MB':>6} {'v1 encode s':>11} {'v1 decode s':>11}")
        rows = []
        for world in args.world or worlds:
            r = run(layout, world)
            rows.append(r)
            print(f"{r['world']:>6} {r['specs']:>10,} {r['boxes']:>9,} {r['t_save']:>11.2f} {r['balance']:>8.3f} "
                  f"{r['meta_mb']:>11.1f} {r['t_encode']:>8.2f} {r['t_parse']:>8.2f} {r['t_load']:>11.2f} "
                  f"{r['read_gb']:>12.1f} {r['total_gb']:>8.1f} {r['peak_mb']:>8.0f} {r['meta_v1_mb']:>6.1f} "
                  f"{r['t_encode_v1']:>11.2f} {r['t_parse_v1']:>11.2f}", flush=True)
            if world == worlds[-1]:
                ok = (r["t_save"] + r["t_gather"] < save_s
                      and r["t_load"] + r["t_load_request"] + r["t_load_join"] < load_s
                      and r["t_parse"] < (decode_s or math.inf)
                      and r["peak_mb"] < peak_mb and r["meta_mb"] < (meta_mb or math.inf))
                print(f"       targets (each plan with the joining of its gathers): {'met' if ok else 'MISSED'}")
        print(f"the coordinator's collectives, MB as sent (s at {LINK_GBS:g} GB/s), and its joining of the gathered specs:")
        print(f"{'ranks':>6} {'plan gather MB':>14} {'s':>5} {'padded MB':>9} {'s':>5} {'flat gather MB':>14} {'s':>5} {'join s':>10} "
              f"{'plan send MB':>12} {'s':>5} {'making s':>8} {'commit gather MB':>16} {'s':>5}")
        for r in rows:
            print(f"{r['world']:>6} {r['gather_mb']:>14,.0f} {link_s(r['gather_mb']):>5.2f} {r['gather_padded_mb']:>9,.0f} "
                  f"{link_s(r['gather_padded_mb']):>5.2f} {r['gather_flat_mb']:>14,.0f} "
                  f"{link_s(r['gather_flat_mb']):>5.2f} {r['t_gather']:>10.2f} {r['send_mb']:>12,.0f} "
                  f"{link_s(r['send_mb']):>5.2f} {r['t_send']:>8.2f} {r['commit_mb']:>16,.0f} {link_s(r['commit_mb']):>5.2f}")
        print("a load's two all-gathers before the read-once assignment (every rank's request, then its share of "
              f"the reads: their sum, and padded to the largest as gathered), MB each rank receives "
              f"(s at {LINK_GBS:g} GB/s), and its joining (torch s: taking both apart as all_gather_object does, "
              f"before any joining):")
        print(f"{'ranks':>6} {'request MB':>10} {'s':>5} {'join s':>10} {'reads MB':>8} {'s':>5} "
              f"{'padded MB':>9} {'s':>5} {'flat reads MB':>13} {'s':>5} {'join s':>10} {'torch s':>8}")
        for r in rows:
            print(f"{r['world']:>6} {r['load_request_mb']:>10,.0f} {link_s(r['load_request_mb']):>5.2f} "
                  f"{r['t_load_request']:>10.2f} {r['load_gather_mb']:>8,.0f} {link_s(r['load_gather_mb']):>5.2f} "
                  f"{r['load_padded_mb']:>9,.0f} {link_s(r['load_padded_mb']):>5.2f} "
                  f"{r['load_flat_mb']:>13,.0f} {link_s(r['load_flat_mb']):>5.2f} {r['t_load_join']:>10.2f} {r['t_load_torch']:>8.2f}")
    print(f"process max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
