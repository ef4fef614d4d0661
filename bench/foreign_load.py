"""Starting an FSDP2 job from an HF safetensors directory: ckpt_plugins' in-place load against the
ways a user has today, side by side, in one process tree per method.

An HF Llama (fp32, ~0.9 GB by default) is saved with `save_pretrained` in several shards. Each
method then fills a 4-rank FSDP2 model from it, page cache dropped before each:
- ours: `cp.load(dir, {"model": model})` into the sharded model (every stored byte read by one
  rank, row shards read by their own rank);
- from_pretrained: `from_pretrained` on every rank, then `fully_shard` (what the Trainer does);
- dcp-hf: DCP's `HuggingFaceStorageReader` into `get_model_state_dict`, then `set_model_state_dict`.
The machine's read limit is one process reading the same files sequentially, cold, in the same run.

Printed per method: seconds (median), bytes the ranks asked storage for (ours: measured, summed
over ranks; the peers: what their reads cover, by construction: every rank reads every tensor with
from_pretrained, its row shard with dcp-hf), bytes the disk served (/proc/<pid>/io read_bytes,
summed over ranks: one host's shared page cache makes repeated reads free here, which shared
storage does not), and ratios ours / peer and method / read limit. Weights are checked equal to
`from_pretrained`'s, bit for bit, for every method. Deletes what it wrote.

Run: .venv/bin/python bench/foreign_load.py [--layers 12] [--ranks 4] [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from distributed import run_ranks  # noqa: E402
from save_load import drop_cache  # noqa: E402  (bench/ is the script's directory)

METHODS = ("ours", "from_pretrained", "dcp-hf")


def config(layers: int):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False)


def disk_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def sharded(model):
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def empty_model(layers: int):
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(config(layers))
    model = sharded(model)
    model.to_empty(device="cpu")
    return model


def run_method(rank, world, method, hf_dir, layers, out):
    import ckpt_plugins as cp
    dist.barrier()
    disk0, t0 = disk_read_bytes(), time.perf_counter()
    asked, built = 0, 0.0
    if method == "from_pretrained":  # builds the model as it reads
        from transformers import LlamaForCausalLM
        model = sharded(LlamaForCausalLM.from_pretrained(hf_dir))
    else:
        model = empty_model(layers)
        dist.barrier()
        built = time.perf_counter() - t0
        if method == "ours":
            asked = cp.load(hf_dir, {"model": model}).read_bytes
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import HuggingFaceStorageReader
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
            sd = get_model_state_dict(model)
            dcp.load(sd, storage_reader=HuggingFaceStorageReader(hf_dir))
            set_model_state_dict(model, sd)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    figures = torch.tensor([elapsed - built, float(asked), float(disk_read_bytes() - disk0), elapsed],
                           dtype=torch.float64)
    gathered = [torch.zeros_like(figures) for _ in range(world)]
    dist.all_gather(gathered, figures)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({"seconds": max(g[0].item() for g in gathered), "asked": sum(g[1].item() for g in gathered),
                    "disk": sum(g[2].item() for g in gathered), "total": max(g[3].item() for g in gathered),
                    "weights": full}, out)


def read_limit(hf_dir: str) -> float:
    drop_cache(hf_dir)
    buf = bytearray(8 << 20)
    t = time.perf_counter()
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            with open(os.path.join(hf_dir, name), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="ckpt_foreign_", dir=args.dir)
    try:
        from transformers import LlamaForCausalLM
        torch.manual_seed(0)
        hf_dir = os.path.join(root, "hf")
        model = LlamaForCausalLM(config(args.layers))
        model.save_pretrained(hf_dir, max_shard_size="200MB")
        reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
        del model
        tensor_bytes = sum(t.nbytes for t in reference.values())
        files = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
        print(f"HF Llama: {tensor_bytes / 1e9:.2f} GB of fp32 tensors in {len(files)} safetensors files; "
              f"{args.ranks} ranks, FSDP2; medians of {args.reps}, page cache dropped before each")
        results = {m: [] for m in METHODS}
        limits = []
        for _ in range(args.reps):
            limits.append(read_limit(hf_dir))
            for method in METHODS:
                drop_cache(hf_dir)
                out = os.path.join(root, f"{method}.pt")
                run_ranks(args.ranks, run_method, method, hf_dir, args.layers, out)
                got = torch.load(out)
                os.remove(out)
                bad = [k for k in reference if not torch.equal(got["weights"][k], reference[k])]
                if bad:
                    raise SystemExit(f"{method}: weights differ from from_pretrained's: {bad[:3]}")
                results[method].append(got)
        limit = statistics.median(limits)
        print(f"read limit (one process, sequential, cold): {limit:.2f} s = {tensor_bytes / limit / 1e9:.2f} GB/s")
        asked_by_construction = {"from_pretrained": args.ranks * tensor_bytes, "dcp-hf": tensor_bytes}
        med = {}
        print("seconds: filling the sharded model (from_pretrained: building it too, as it reads), and in all "
              "(with building the sharded model on the meta device first)")
        print(f"{'method':<16} {'fill s':>7} {'total s':>8} {'asked (x tensor bytes)':>24} {'disk (x)':>9} "
              f"{'fill / read limit':>18}")
        for method in METHODS:
            runs = results[method]
            med[method] = statistics.median(r["seconds"] for r in runs)
            total = statistics.median(r["total"] for r in runs)
            asked = statistics.median(r["asked"] for r in runs) if method == "ours" else asked_by_construction[method]
            how = "measured" if method == "ours" else "by construction"
            disk = statistics.median(r["disk"] for r in runs)
            print(f"{method:<16} {med[method]:>7.2f} {total:>8.2f} {asked / tensor_bytes:>9.2f} ({how:>15}) "
                  f"{disk / tensor_bytes:>9.2f} {med[method] / limit:>18.2f}")
        best = min(med[m] for m in METHODS if m != "ours")
        print(f"\nratios: ours / best peer {med['ours'] / best:.2f} (best peer: "
              f"{min((m for m in METHODS if m != 'ours'), key=med.get)}); ours / read limit {med['ours'] / limit:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
