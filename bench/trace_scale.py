"""`bcp trace` at scale: a simulated 1,024-rank save (128 hosts x 8 ranks, one slow disk) rendered
as report, heatmap PNG and Perfetto trace. Target: under 10 s in all.

Run: .venv/bin/python bench/trace_scale.py [--ranks 1024]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from ckpt_plugins._src import trace
from ckpt_plugins._src.telemetry import Phase, RankTelemetry, checkpoint_file, read_records, summary


def simulated(ranks: int, per_host: int = 8, seed: int = 0):
    rng = random.Random(seed)
    slow = rng.randrange(ranks)
    out = []
    for r in range(ranks):
        t, phases = 0.0, []
        for name, base, nbytes in (("plan", 0.02, 0), ("staging", 0.001, 0), ("snapshot", 0.08, 550 << 20),
                                   ("write", 0.9, 550 << 20), ("checksum", 0.05, 550 << 20)):
            seconds = base * rng.uniform(0.9, 1.1) * (4.0 if name == "write" and r == slow else 1.0)
            phases.append(Phase(name, t, t + seconds, seconds, nbytes, 1))
            t += seconds
        phases.append(Phase("commit_wait", t, 4.0, 4.0 - t, 0, 1))
        out.append(RankTelemetry("save", r, r % per_host, f"host{r // per_host:04d}", "local", 0.0, 4.0, phases))
    return out, slow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--keep", default=None, help="a directory to keep the PNG and trace in")
    args = parser.parse_args()
    ranks, slow = simulated(args.ranks)
    with tempfile.TemporaryDirectory() as scratch:
        out = args.keep or scratch
        os.makedirs(out, exist_ok=True)
        t0 = time.perf_counter()
        data = checkpoint_file(ranks, "save", "sim", 1, {"summary": summary(ranks, args.ranks * (550 << 20))})
        doc = read_records(data)
        t1 = time.perf_counter()
        text = trace.report(doc)
        t2 = time.perf_counter()
        trace.heatmap(doc["ranks"], os.path.join(out, "heatmap.png"))
        t3 = time.perf_counter()
        with open(os.path.join(out, "trace.json"), "w") as f:
            json.dump(trace.chrome_trace(doc["ranks"]), f)
        t4 = time.perf_counter()
        named = f"straggler: rank {slow} in write" in text
        print("\n".join(line for line in text.splitlines() if line.startswith(("straggler", "bound"))))
        print(f"{args.ranks} ranks: telemetry file {len(data) / 2**20:.1f} MiB, encode+parse {t1 - t0:.2f} s, "
              f"report {t2 - t1:.2f} s, heatmap {t3 - t2:.2f} s, trace {t4 - t3:.2f} s; "
              f"all {t4 - t0:.2f} s (target < 10 s: {t4 - t0 < 10}); slow rank {slow} named: {named}")


if __name__ == "__main__":
    main()
