"""`bcp export` throughput against this machine's write bandwidth, in one run.

Saves a Llama-shaped model's weights (fp32, ~1 GiB by default) as a ckpt_plugins checkpoint, then
times, cold (page cache dropped before each): the export (read + verify + write safetensors,
streamed; in-process, so the CLI's start-up is reported apart), safetensors' own `save_file` of
the same weights from memory (the peer), and the machine's sequential writes (O_DIRECT and
buffered, + fsync) and cold read of the same byte count in the same directory. The export reads
and writes at once, so its limit is the slower of the best write and the cold read. Prints
medians and ratios; deletes everything it wrote.

Run: .venv/bin/python bench/export.py [--gib 1] [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import ckpt_plugins as cp
from save_load import drop_cache  # bench/ is the script's directory


def weights(gib: float) -> dict:
    """Llama-like tensors (hidden 2048, ffn 5632) until `gib` of fp32."""
    hidden, ffn, out, layer = 2048, 5632, {}, 0
    out["model.embed_tokens.weight"] = torch.randn(32000, hidden)
    while sum(t.numel() * 4 for t in out.values()) < gib * 2**30:
        p = f"model.layers.{layer}"
        for name, shape in (("self_attn.q_proj", (hidden, hidden)), ("self_attn.k_proj", (hidden, hidden)),
                            ("self_attn.v_proj", (hidden, hidden)), ("self_attn.o_proj", (hidden, hidden)),
                            ("mlp.gate_proj", (ffn, hidden)), ("mlp.up_proj", (ffn, hidden)),
                            ("mlp.down_proj", (hidden, ffn))):
            out[f"{p}.{name}.weight"] = torch.randn(shape)
        out[f"{p}.input_layernorm.weight"] = torch.ones(hidden)
        layer += 1
    return out


def write_limit(root: str, nbytes: int, direct: bool) -> float:
    raw = np.empty((8 << 20) + 4096, dtype=np.uint8)
    start = (-raw.ctypes.data) % 4096
    buf = memoryview(raw[start:start + (8 << 20)])
    buf[:] = b"\x01" * len(buf)
    path = os.path.join(root, "limit.bin")
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0))
    for _ in range(0, nbytes, len(buf)):
        os.write(fd, buf)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t


def read_limit(root: str) -> float:
    path = os.path.join(root, "limit.bin")
    drop_cache(root)
    buf = bytearray(8 << 20)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    elapsed = time.perf_counter() - t
    os.remove(path)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="ckpt_export_", dir=args.dir)
    bcp = os.path.join(os.path.dirname(sys.executable), "bcp")
    try:
        tensors = weights(args.gib)
        nbytes = sum(t.numel() * 4 for t in tensors.values())
        ckpt = os.path.join(root, "ckpt")
        cp.save(ckpt, {"model": tensors})
        from safetensors.torch import save_file

        from hf_ext.safetensors_io import export_hf
        times = {"export (ours, streamed, cold read)": [], "safetensors save_file (peer, from memory)": [],
                 "write limit, O_DIRECT": [], "write limit, buffered": [], "cold read limit": []}
        for rep in range(args.reps):
            drop_cache(ckpt)
            out = os.path.join(root, f"hf{rep}")
            t = time.perf_counter()
            export_hf(ckpt, out)
            times["export (ours, streamed, cold read)"].append(time.perf_counter() - t)
            shutil.rmtree(out)
            t = time.perf_counter()
            path = os.path.join(root, "peer.safetensors")
            save_file(tensors, path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)  # durable, as the export is
            os.close(fd)
            times["safetensors save_file (peer, from memory)"].append(time.perf_counter() - t)
            os.remove(path)
            times["write limit, buffered"].append(write_limit(root, nbytes, direct=False))
            times["write limit, O_DIRECT"].append(write_limit(root, nbytes, direct=True))
            times["cold read limit"].append(read_limit(root))
        t = time.perf_counter()
        subprocess.run([bcp, "--help"], check=True, capture_output=True)
        startup = time.perf_counter() - t
        med = {name: statistics.median(values) for name, values in times.items()}
        limit = max(min(med["write limit, O_DIRECT"], med["write limit, buffered"]), med["cold read limit"])
        print(f"{len(tensors)} tensors, {nbytes / 2**30:.2f} GiB fp32; medians of {args.reps}")
        for name, value in med.items():
            print(f"  {name:<42} {value:7.3f} s  {nbytes / value / 1e9:5.2f} GB/s  {value / limit:5.2f}x the limit")
        print(f"limit = max(best write, cold read) = {limit:.3f} s; the bcp command adds {startup:.1f} s of "
              "start-up (importing torch)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
