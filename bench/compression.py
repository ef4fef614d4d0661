"""Lossless compression on trained weights: ours against plain, PyTorch DCP's zstd extension and
zipnn, side by side in one run.

Trains a small Llama (transformers, built from a config: no download) on a learnable synthetic
corpus (a fixed sparse Markov chain over the vocabulary) for `--steps` AdamW steps on the CPU, so
the tensors are trained ones, not an initialization. Then saves, on the same tensors, their bf16
weights, fp32 masters and fp32 Adam moments (as three groups of plain tensors, so nothing is left
out as another's cast) with each method:

- plain: ckpt_plugins `save_async` / `load`;
- ours: the same with `compress=True` (each chunk's bytes grouped by position, then zstd);
- DCP zstd: `torch.distributed.checkpoint.save` through `FileSystemWriter(_extensions=[ZStandard()])`
  (DCP's stream transform: each tensor's bytes as they are, then zstd), and its `load`;
- zipnn: `zipnn.ZipNN` on each tensor (its byte grouping, Huffman or zstd per group; given a copy,
  timed with it, since it reorders its input in place), the results written to one file with
  fsync, read back and decompressed.

Then `compress="auto"` against storage speed: plain, compressed and auto saves of the same state
onto this machine's disk and onto the same disk held to a rank's share of a slower filesystem
(`--rates`, MB/s: every write of the save's writers waits for a link of that bandwidth they
share), with each commit and the bytes stored: auto should commit as fast as the faster of the
other two at every rate.

Then ours as deltas: a compressed save, and one delta per optimizer step over `--delta-steps`
steps at an RL post-training learning rate (`--delta-lr`), each against the save before (a chain)
and then each against the first (one deep): the share of bf16 weights that changed, the bytes each
group's delta takes, each commit, and the load of the last delta.

Per method: bytes stored (per group and in all), the stall (how long the save call blocks; DCP's
and zipnn's saves are synchronous: all of it), the time to a durable checkpoint, the load (page
cache dropped), medians of `--reps`, and ratios to plain; every load is checked bit for bit. The
machine's write limit (O_DIRECT) is printed beside: what compression must beat to speed a commit.
Deletes everything it wrote.

Run: .venv/bin/python bench/compression.py [--steps 200] [--reps 3] [--rates 1000 500 250]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List

import torch

import ckpt_plugins as cp
from ckpt_plugins._src.optional import require
from ckpt_plugins._src.storage import LocalStorage, Writer
from export import write_limit  # bench/ is the script's directory
from save_load import dir_bytes, drop_cache

GROUPS = ("weights_bf16", "masters_fp32", "moments_fp32")


class Run:
    """A small Llama trained with AdamW on a learnable corpus (a fixed sparse Markov chain over the
    vocabulary: each token has 4 likely successors)."""

    def __init__(self, seed: int = 0):
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(seed)
        self.vocab = 8192
        config = LlamaConfig(vocab_size=self.vocab, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
        self.model = LlamaForCausalLM(config)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, self.vocab, (self.vocab, 4), generator=self.g)

    def train(self, steps: int) -> List[float]:
        losses = []
        for _ in range(steps):
            tokens = torch.empty(8, 128, dtype=torch.long)
            tokens[:, 0] = torch.randint(0, self.vocab, (8,), generator=self.g)
            for i in range(1, 128):
                tokens[:, i] = self.successors[tokens[:, i - 1], torch.randint(0, 4, (8,), generator=self.g)]
            loss = self.model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            losses.append(loss.item())
        return losses

    def state(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """Its tensors by group, copied."""
        names = dict(self.model.named_parameters())
        return {"weights_bf16": {n: p.detach().to(torch.bfloat16) for n, p in names.items()},
                "masters_fp32": {n: p.detach().clone() for n, p in names.items()},
                "moments_fp32": {f"{n}.{k}": self.opt.state[p][k].clone() for n, p in names.items()
                                 for k in ("exp_avg", "exp_avg_sq")}}


def zeros_like(state):
    return {g: {k: torch.zeros_like(v) for k, v in t.items()} for g, t in state.items()}


def same(a, b) -> bool:
    return all(torch.equal(a[g][k].view(torch.uint8), b[g][k].view(torch.uint8)) for g in a for k in a[g])


class Method:
    """One way to store the state: `save(path) -> stall seconds` (durable when it returns, or when
    `wait()` does), `load(path) -> state`, `group_bytes(path) -> bytes per group`."""
    name = ""

    def wait(self) -> None:
        pass


class Link(LocalStorage):
    """A local directory whose data files' writers share a link of `rate` bytes/s: each write
    returns once the link has carried it (after the disk has taken it)."""

    def __init__(self, root: str, rate: float):
        super().__init__(root)
        self.rate, self.free_at, self.lock = rate, 0.0, threading.Lock()

    def open_writer(self, name):
        writer = super().open_writer(name)
        return _LinkWriter(writer, self) if name.startswith("data/") else writer


class _LinkWriter(Writer):
    def __init__(self, inner: Writer, link: Link):
        self.inner, self.link = inner, link

    def write(self, data) -> None:
        self.inner.write(data)
        with self.link.lock:
            start = max(time.perf_counter(), self.link.free_at)
            self.link.free_at = done = start + len(memoryview(data).cast("B")) / self.link.rate
        time.sleep(max(0.0, done - time.perf_counter()))

    def close(self) -> None:
        self.inner.close()


class Ours(Method):
    def __init__(self, state, compress, rate: float = 0.0):
        self.state, self.compress, self.rate = state, compress, rate
        self.name = {False: "plain", True: "ours compressed", "auto": "ours auto"}[compress]
        self.ckpt = cp.Checkpointer()

    def save(self, path) -> float:
        t = time.perf_counter()
        self.handle = self.ckpt.save_async(Link(path, self.rate) if self.rate else path, self.state,
                                           compress=self.compress)
        return time.perf_counter() - t

    def wait(self) -> None:
        self.handle.wait()

    def load(self, path):
        out = zeros_like(self.state)
        self.ckpt.load(path, out)
        return out

    def group_bytes(self, path) -> Dict[str, int]:
        meta = cp.read_metadata(path)
        return {g: sum(b.stored_nbytes for k, t in meta.tensors.items() if k.startswith(g + "/") for b in t.boxes)
                for g in GROUPS}


class DcpZstd(Method):
    name = "DCP zstd"

    def __init__(self, state):
        require("zstandard", "DCP's ZStandard extension")
        self.state = state

    def save(self, path) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._extension import ZStandard
        t = time.perf_counter()
        dcp.save(self.state, storage_writer=dcp.FileSystemWriter(path, _extensions=[ZStandard()], thread_count=2))
        return time.perf_counter() - t

    def load(self, path):
        import torch.distributed.checkpoint as dcp
        out = zeros_like(self.state)
        dcp.load(out, storage_reader=dcp.FileSystemReader(path))
        return out

    def group_bytes(self, path) -> Dict[str, int]:
        import torch.distributed.checkpoint as dcp
        meta = dcp.FileSystemReader(path).read_metadata()
        sizes = {g: 0 for g in GROUPS}
        for index, info in meta.storage_data.items():
            sizes[index.fqn.split(".", 1)[0]] += info.length
        return sizes


class ZipNN(Method):
    name = "zipnn"

    def __init__(self, state):
        self.zipnn = require("zipnn", "the zipnn comparison", "pip install zipnn")
        self.state = state
        self.codecs = {dtype: self.zipnn.ZipNN(input_format="torch", bytearray_dtype=name, threads=2)
                       for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32"))}

    def save(self, path) -> float:
        t = time.perf_counter()
        os.makedirs(path)
        self.lengths = {}
        with open(os.path.join(path, "data.bin"), "wb") as f:
            for g, tensors in self.state.items():
                for k, v in tensors.items():
                    blob = self.codecs[v.dtype].compress(v.clone())  # it reorders its input in place
                    f.write(blob)
                    self.lengths[g, k] = len(blob)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - t

    def load(self, path):
        out = zeros_like(self.state)
        with open(os.path.join(path, "data.bin"), "rb") as f:
            for g, tensors in self.state.items():
                for k, v in tensors.items():
                    got = self.codecs[v.dtype].decompress(f.read(self.lengths[g, k]))
                    out[g][k].copy_(got.view(v.dtype).view(v.shape))
        return out

    def group_bytes(self, path) -> Dict[str, int]:
        return {g: sum(n for (h, _), n in self.lengths.items() if h == g) for g in GROUPS}


def measure(method: Method, state, root: str, reps: int) -> dict:
    stalls, commits, loads = [], [], []
    for rep in range(reps):
        path = os.path.join(root, f"{method.name.replace(' ', '_')}-{rep}")
        t = time.perf_counter()
        stalls.append(method.save(path))
        method.wait()
        commits.append(time.perf_counter() - t)
        drop_cache(path)
        t = time.perf_counter()
        got = method.load(path)
        loads.append(time.perf_counter() - t)
        assert same(got, state), f"{method.name}: the load differs from what was saved"
        groups, total = method.group_bytes(path), dir_bytes(path)
        shutil.rmtree(path)
    return {"stall": statistics.median(stalls), "commit": statistics.median(commits),
            "load": statistics.median(loads), "groups": groups, "bytes": total}


def deltas(run: Run, root: str, steps: int, lr: float, against: str) -> None:
    """Ours as deltas: a compressed save, then one delta per optimizer step, at an RL post-training
    learning rate, against the one before (`against` "previous": a chain, each read going down it)
    or against the first ("first": every delta one deep, each holding every change since); the
    last loaded bit for bit."""
    for group in run.opt.param_groups:
        group["lr"] = lr
    ckpt, state = cp.Checkpointer(), run.state()
    first = os.path.join(root, "delta-0")
    ckpt.save(first, state, compress=True)
    sizes = Ours(state, True).group_bytes(first)
    raw = {g: sum(v.numel() * v.element_size() for v in t.values()) for g, t in state.items()}
    print(f"\nours as deltas over {steps} optimizer steps at lr {lr:g}, each against the {against} save "
          "(MB; x: the group's plain bytes / stored)")
    print(f"{'step':<6}{'bf16 changed':>14}" + "".join(f"{g:>22}" for g in GROUPS) + f"{'commit s':>10}")
    print(f"{'full':<6}{'':>14}" + "".join(f"{sizes[g] / 1e6:>15.2f} {raw[g] / sizes[g]:>5.2f}x" for g in GROUPS))
    ratios = []
    for step in range(1, steps + 1):
        before = state["weights_bf16"]
        run.train(1)
        state = run.state()
        changed = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in
                      zip(before.values(), state["weights_bf16"].values())) / sum(v.numel() for v in before.values())
        path = os.path.join(root, f"delta-{step}")
        t = time.perf_counter()
        ckpt.save(path, state, delta_from=os.path.join(root, f"delta-{step - 1 if against == 'previous' else 0}"),
                  max_chain=steps)
        commit = time.perf_counter() - t
        sizes = Ours(state, True).group_bytes(path)
        ratios.append(raw["weights_bf16"] / max(1, sizes["weights_bf16"]))
        print(f"{step:<6}{changed:>13.1%} " + "".join(f"{sizes[g] / 1e6:>15.2f} {raw[g] / max(1, sizes[g]):>5.2f}x"
                                                       for g in GROUPS) + f"{commit:>10.3f}")
    drop_cache(root)
    t = time.perf_counter()
    got = Ours(state, True).load(path)
    seconds, depth = time.perf_counter() - t, cp.read_metadata(path).delta.depth
    for step in range(steps + 1):
        shutil.rmtree(os.path.join(root, f"delta-{step}"))
    print(f"the last, {depth} delta(s) deep, loads in {seconds:.3f} s (page cache dropped), bit for bit: "
          f"{same(got, state)}; bf16 weights: a full plain save / a delta = {statistics.median(ratios):.1f}x (median)")


def against_speed(state, root: str, reps: int, rates: List[float], limit: float) -> None:
    """Plain, compressed and auto saves onto the disk and onto links of `rates` MB/s: commits and
    bytes stored, auto's commit against the faster of the other two."""
    print("\ncompress=\"auto\" against storage speed: commit s (stored MB), medians of", reps)
    print(f"{'MB/s':>10}{'plain':>18}{'compressed':>18}{'auto':>18}{'auto/best':>11}{'auto/limit':>12}")
    raw = sum(v.numel() * v.element_size() for t in state.values() for v in t.values())
    for rate in [0.0] + rates:
        rows = {mode: measure(Ours(state, mode, rate * 1e6), state, root, reps) for mode in (False, True, "auto")}
        best = min(rows[False]["commit"], rows[True]["commit"])
        at = rate * 1e6 or limit  # the write limit: the link's, or the disk's
        print(f"{rate or limit / 1e6:>9.0f}{'' if rate else '*'}"
              + "".join(f"{r['commit']:>10.3f} ({r['bytes'] / 1e6:>5.1f})" for r in rows.values())
              + f"{rows['auto']['commit'] / best:>11.2f}{rows['auto']['commit'] / (raw / at):>12.2f}")
    print("(*: this machine's disk, O_DIRECT; auto/limit: auto's commit / the plain bytes' time at the write limit)")


def report(rows: Dict[str, dict], raw: Dict[str, int], limit: float) -> None:
    plain = rows["plain"]
    print(f"\nbytes stored (MB) and ratio to the tensors' own bytes; the machine writes {limit / 1e6:.0f} MB/s (O_DIRECT)")
    print(f"{'method':<16}" + "".join(f"{g:>22}" for g in GROUPS) + f"{'all files':>18}")
    print(f"{'(tensors)':<16}" + "".join(f"{raw[g] / 1e6:>15.1f}      " for g in GROUPS))
    for name, r in rows.items():
        print(f"{name:<16}" + "".join(f"{r['groups'][g] / 1e6:>15.1f} {raw[g] / r['groups'][g]:>5.2f}x" for g in GROUPS)
              + f"{r['bytes'] / 1e6:>11.1f} {plain['bytes'] / r['bytes']:>5.2f}x")
    print(f"\n{'method':<16}{'stall s':>9}{'commit s':>10}{'load s':>9}{'stall/plain':>13}{'commit/plain':>14}"
          f"{'load/plain':>12}")
    for name, r in rows.items():
        print(f"{name:<16}{r['stall']:>9.3f}{r['commit']:>10.3f}{r['load']:>9.3f}{r['stall'] / plain['stall']:>13.2f}"
              f"{r['commit'] / plain['commit']:>14.2f}{r['load'] / plain['load']:>12.2f}")
    ours, dcp = rows["ours compressed"], rows.get("DCP zstd")
    if dcp is not None:
        print(f"\nours / DCP zstd, bytes: bf16 weights {ours['groups']['weights_bf16'] / dcp['groups']['weights_bf16']:.3f}, "
              f"all {ours['bytes'] / dcp['bytes']:.3f}")


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory here)")
    parser.add_argument("--delta-steps", type=int, default=10)
    parser.add_argument("--delta-lr", type=float, default=1e-6)
    parser.add_argument("--rates", type=float, nargs="*", default=[1000, 500, 250],
                        help="links to compare compress='auto' on, MB/s")
    args = parser.parse_args(argv)
    run, t0 = Run(), time.time()
    losses = run.train(args.steps)
    print(f"trained {sum(p.numel() for p in run.model.parameters()) / 1e6:.1f}M parameters for {args.steps} steps "
          f"in {time.time() - t0:.0f} s: loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    state = run.state()
    raw = {g: sum(v.numel() * v.element_size() for v in t.values()) for g, t in state.items()}
    root = tempfile.mkdtemp(prefix="bench-compression-", dir=args.dir or os.getcwd())
    try:
        limit = sum(raw.values()) / write_limit(root, sum(raw.values()), direct=True)
        os.remove(os.path.join(root, "limit.bin"))
        methods: List[Callable[[], Method]] = [lambda: Ours(state, False), lambda: Ours(state, True),
                                               lambda: DcpZstd(state), lambda: ZipNN(state)]
        rows = {}
        for make in methods:
            method = make()
            rows[method.name] = measure(method, state, root, args.reps)
            print(f"{method.name}: {rows[method.name]['bytes'] / 1e6:.1f} MB, commit {rows[method.name]['commit']:.3f} s",
                  flush=True)
        report(rows, raw, limit)
        against_speed(state, root, args.reps, args.rates, limit)
        for against in ("previous", "first") if args.delta_steps else ():
            deltas(run, root, args.delta_steps, args.delta_lr, against)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
