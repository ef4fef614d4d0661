"""Telemetry with real processes: a rank made slow in one phase is named the straggler in that
phase; a replicated load shows the bytes that came from other ranks, not from storage; the
heatmap PNG and the Perfetto trace are produced and parse; the run's history; a missing or
corrupt telemetry file never fails a load; and the frameworks' own loggers receive the figures
(the HF Trainer's is in test_hf_trainer.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import ckpt_plugins as cp
from ckpt_plugins._src import trace
from ckpt_plugins._src.manager import CheckpointManager
from ckpt_plugins._src.storage import storage_for
from ckpt_plugins._src.telemetry import HISTORY_FILE, TELEMETRY_FILE, RankTelemetry
from distributed import run_env_ranks, run_ranks
from faults import Armed, state, values
from test_cli import without

BCP = os.path.join(os.path.dirname(sys.executable), "bcp")
SLOW = 2  # the rank whose writes are slow
DELAY = 0.5  # seconds added to each of its writes


def slow_writes_worker(rank, world, root, out):
    from faults import FaultyStorage
    if rank == SLOW:
        FaultyStorage.FAULTS["write"] = lambda writer, data: (time.sleep(DELAY), writer.write(data))
    manager = CheckpointManager(f"faulty://{root}")
    for step in (1, 2):
        info = manager.save(step, state(rank, world, step, Armed())[0])
        assert info.telemetry.rank == rank and info.telemetry.phase("write") is not None
    if rank == 0:  # the coordinating rank holds every rank's record
        assert sorted(r.rank for r in info.ranks) == list(range(world))
    result = manager.load(state(rank, world, 0, Armed())[0])
    assert sorted(r.rank for r in result.ranks) == (list(range(world)) if rank == 0 else [rank])
    assert result.telemetry.phase("read").bytes > 0 or result.telemetry.phase("receive") is not None


def test_a_slow_rank_is_named_the_straggler_of_its_phase_and_the_outputs_parse(tmp_path):
    root, out = tmp_path / "run", tmp_path / "out"
    run_ranks(3, slow_writes_worker, str(root), str(out))
    step = root / "step_2"
    doc = trace.load_telemetry(storage_for(step))
    got = subprocess.run([BCP, "trace", str(step), "--out", str(out)], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    print(got.stdout)
    assert f"straggler: rank {SLOW} in write" in got.stdout
    assert "bound by: storage (writes)" in got.stdout
    report_row = next(line for line in got.stdout.splitlines() if line.strip().startswith("write "))
    assert report_row.split()[1] == str(SLOW)  # the slowest rank of the write phase
    # the heatmap is a PNG matplotlib reads back; the trace is JSON with one track per rank
    import matplotlib.image
    png = out / "step_2-heatmap.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and matplotlib.image.imread(png).shape[0] > 100
    events = json.loads((out / "step_2-trace.json").read_text())["traceEvents"]
    tracks = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert tracks == {0, 1, 2}
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1, 2} and all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    assert {"snapshot", "write", "plan"} <= {e["name"] for e in slices if e["pid"] == SLOW}
    files = [e for e in slices if e["pid"] == SLOW and e["name"].startswith("write data/")]  # one track each
    assert len(files) >= 1 and all(e["tid"] > 0 and e["args"]["bytes"] > 0 for e in files)
    assert len(doc["ranks"]) == 3
    # the run's history: both saves and the load, as a table and a plot
    rows = trace.read_history((root / HISTORY_FILE).read_bytes())
    assert [(r["op"], r["step"]) for r in rows] == [("save", 1), ("save", 2), ("load", 2)]
    assert all(r["bytes"] > 0 and r["slowest_rank"] == SLOW for r in rows if r["op"] == "save")
    got = subprocess.run([BCP, "trace", str(root), "--history", "--out", str(out)], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert len([line for line in got.stdout.splitlines() if line.split()[:2] in (["1", "save"], ["2", "save"])]) == 2
    assert (out / "run-history.png").read_bytes()[:4] == b"\x89PNG"
    # without matplotlib: the report, the table and the trace as before; the plots name their install
    bare = tmp_path / "bare"
    for args, made, printed in (([str(step)], ["step_2-trace.json"], f"straggler: rank {SLOW} in write"),
                                ([str(root), "--history"], ["step_2-trace.json"], "commit s")):
        got = subprocess.run([*without("matplotlib"), "trace", *args, "--out", str(bare)], capture_output=True,
                             text=True)
        assert got.returncode == 0, got.stderr
        assert printed in got.stdout
        assert "not drawn (bcp trace's plots needs matplotlib" in got.stdout
        assert "pip install 'ckpt_plugins[trace]'" in got.stdout
        assert sorted(os.listdir(bare)) == made


def replicated_load_worker(rank, world, path, out):
    cp.save(path, state(rank, world, 1, Armed())[0])
    fresh, (rep, own) = state(rank, world, 0, Armed())
    result = cp.load(path, fresh)
    assert torch.equal(rep, values(rank, world, 1)[0])
    if rank == 0:
        torch.save([r.to_dict() for r in result.ranks], out)


def test_a_replicated_load_reads_once_and_shows_the_bytes_from_peers(tmp_path):
    path, out = str(tmp_path / "c"), str(tmp_path / "ranks.pt")
    run_ranks(3, replicated_load_worker, path, out)
    ranks = [RankTelemetry.from_dict(r) for r in torch.load(out)]
    stored = sum(b.nbytes for t in cp.read_metadata(path).tensors.values() for b in t.boxes)
    rep = values(0, 3, 1)[0]
    read = sum(r.phase("read").bytes for r in ranks if r.phase("read"))
    from_peers = sum(r.phase("receive").bytes for r in ranks if r.phase("receive"))
    assert read == stored  # every stored byte once
    assert from_peers == 2 * rep.numel() * rep.element_size()  # the replicated tensor, to the 2 others
    text = trace.report({"ranks": ranks, "path": path, "step": None})
    print(text)
    assert "read once" in text and "(1.00x)" in text
    assert f"{from_peers / 2**20:.1f} MiB from other ranks" in text


def test_a_missing_or_corrupt_telemetry_file_never_fails_a_load(tmp_path):
    path = tmp_path / "c"
    cp.save(path, {"w": torch.arange(10.0)})
    assert (path / TELEMETRY_FILE).exists()
    for damage in ("corrupt", "missing"):
        if damage == "corrupt":
            (path / TELEMETRY_FILE).write_text("{not json")
        else:
            (path / TELEMETRY_FILE).unlink()
        w = torch.zeros(10)
        cp.load(path, {"w": w})
        assert torch.equal(w, torch.arange(10.0))
        got = subprocess.run([BCP, "trace", str(path)], capture_output=True, text=True)
        assert got.returncode == 1 and got.stderr.count("\n") == 1, got.stderr
        assert ("not valid telemetry JSON" if damage == "corrupt" else f"has no {TELEMETRY_FILE}") in got.stderr


def test_the_heatmap_groups_ranks_by_host_when_there_are_many(tmp_path):
    ranks = [RankTelemetry("save", r, r % 8, f"host{r // 8:03d}", "local", 0.0, 1.0) for r in range(256)]
    for r in ranks:
        r.phases = [trace_phase("snapshot", 0.1), trace_phase("write", 0.5 + (r.rank == 77))]
    trace.heatmap(ranks, str(tmp_path / "h.png"))
    import matplotlib.image
    assert matplotlib.image.imread(tmp_path / "h.png").shape[0] > 200
    assert "straggler: rank 77 in write" in trace.report({"ranks": ranks, "path": "p", "step": 1})


def trace_phase(name, seconds):
    from ckpt_plugins._src.telemetry import Phase
    return Phase(name, 0.0, seconds, seconds, 1 << 20, 1)


# ---------------------------------------------------------------------------- framework loggers


def megatron_logger_worker(rank, world, root, tb_dir):
    from test_megatron_training import hooked_job
    _, model, opt, sched = hooked_job(1, 1, root)
    import megatron_util as mu
    from megatron.training import global_vars, training
    from torch.utils.tensorboard import SummaryWriter
    global_vars._GLOBAL_TENSORBOARD_WRITER = SummaryWriter(log_dir=tb_dir)  # what --tensorboard-dir sets up
    for iteration in (1, 2):
        mu.train_step(model, opt, iteration)
        training.save_checkpoint(iteration, [model], opt, sched, 0.0)
    global_vars.get_tensorboard_writer().flush()
    mu.destroy()


def test_megatron_saves_report_to_megatrons_tensorboard_writer(tmp_path):
    from test_hf_trainer import tensorboard_scalars
    run_ranks(1, megatron_logger_worker, str(tmp_path / "ckpt"), str(tmp_path / "tb"))
    stalls = tensorboard_scalars(tmp_path / "tb", "ckpt/stall_s")
    assert sorted(stalls) == [1, 2] and all(v > 0 for v in stalls.values())
    assert sorted(tensorboard_scalars(tmp_path / "tb", "ckpt/save_gib")) == [1, 2]


def deepspeed_logger_worker(rank, world, root, csv_dir):
    import ds_util
    eng = ds_util.engine(1, False, extra={"csv_monitor": {"enabled": True, "output_path": csv_dir,
                                                          "job_name": "run"}})
    for index in (0, 1):
        ds_util.step(eng, index)
        eng.save_checkpoint(root)
    dist.barrier()


def test_deepspeed_saves_report_to_deepspeeds_monitor(tmp_path):
    run_env_ranks(2, deepspeed_logger_worker, str(tmp_path / "ckpt"), str(tmp_path / "csv"))
    lines = (tmp_path / "csv" / "run" / "ckpt_stall_s.csv").read_text().splitlines()
    assert lines[0].split(",")[0] == "step" and len(lines) == 3  # a header, then one row per save
    assert all(float(line.split(",")[1]) > 0 for line in lines[1:])
