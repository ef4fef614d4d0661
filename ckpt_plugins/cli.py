"""`bcp`: offline tools on checkpoints (no process group, no GPU)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from importlib.metadata import entry_points
from typing import List

from ._src.committed import check_files, read_metadata
from ._src.diff import diff
from ._src.delta import opened
from ._src.engine.read import read_checked
from ._src.errors import CheckpointError, IncompleteCheckpointError
from ._src.format import Metadata
from ._src.optional import MissingDependency
from ._src.progress import progress_bar
from ._src.storage import storage_for


def _summary(metadata: Metadata) -> dict:
    tensors = {}
    for key, meta in metadata.tensors.items():
        tensors[key] = {
            "shape": list(meta.shape), "dtype": meta.dtype,
            "bytes": sum(b.nbytes for b in meta.boxes), "stored_bytes": sum(b.stored_nbytes for b in meta.boxes),
            "boxes": [{"offsets": list(b.offsets), "lengths": list(b.lengths), "file": b.file,
                       "offset": b.offset, "nbytes": b.nbytes, "stored_bytes": b.stored_nbytes,
                       "compressed": bool(b.group)} for b in meta.boxes],
        }
    return {
        "status": "committed", "format": getattr(metadata, "source", "") or "ckpt_plugins", "version": metadata.version, "framework": metadata.framework,
        "layout": metadata.layout, "step": metadata.step, "world_size": metadata.world_size,
        "total_bytes": metadata.total_bytes, "files": metadata.files, "tensors": tensors,
        "aliases": metadata.aliases, "casts": metadata.casts,
        "delta": None if getattr(metadata, "delta", None) is None else asdict(metadata.delta),
        "objects": {k: [{"rank": o.rank, "encoding": o.encoding, "nbytes": o.nbytes} for o in v]
                    for k, v in metadata.objects.items()},
    }


def cmd_inspect(args) -> int:
    try:
        metadata = read_metadata(args.path)
    except IncompleteCheckpointError as exc:
        print(json.dumps({"status": "incomplete", "error": str(exc)}) if args.json else f"INCOMPLETE: {exc}")
        return 2
    info = _summary(metadata)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    fmt = f"format v{info['version']}" if info["format"] == "ckpt_plugins" else f"{info['format']}, read in place"
    print(f"checkpoint {args.path}: {fmt}, from {info['framework']} "
          f"(world size {info['world_size']}, layout {json.dumps(info['layout'])}), step {info['step']}")
    loaded = sum(t["bytes"] for t in info["tensors"].values())
    stored = sum(t["stored_bytes"] for t in info["tensors"].values())
    if info["delta"] is not None:
        print(f"a delta against {info['delta']['path']} ({info['delta']['depth']} deep): unchanged chunks are "
              "not stored, the others as XORs with the same chunks there")
    print(f"{len(info['tensors'])} tensors, {len(info['objects'])} objects, "
          f"{info['total_bytes'] / 1e6:.2f} MB in {len(info['files'])} files"
          + (f"; tensors compressed {loaded / 1e6:.2f} -> {stored / 1e6:.2f} MB ({loaded / stored:.2f}x)"
             if stored < loaded else ""))
    width = max([len(k) for k in info["tensors"]] + [3])
    for key, t in info["tensors"].items():
        stored = (f"cast of {info['casts'][key]}" if key in info["casts"]
                  else f"{len(t['boxes']):>3} box(es) {t['bytes']:>12,} B"
                  + (f" stored in {t['stored_bytes']:,} B" if t["stored_bytes"] < t["bytes"] else ""))
        print(f"  {key:<{width}}  {str(tuple(t['shape'])):<20} {t['dtype']:<9} {stored}")
        if args.boxes:
            for b in t["boxes"]:
                print(f"      offsets {b['offsets']} lengths {b['lengths']} -> {b['file']}@{b['offset']}")
    for alias, target in info["aliases"].items():
        print(f"  {alias:<{width}}  = {target} (tied)")
    for key, objs in info["objects"].items():
        ranks = "replicated" if objs[0]["rank"] is None else f"{len(objs)} per-rank"
        print(f"  {key:<{width}}  object ({objs[0]['encoding']}, {ranks})")
    return 0


def cmd_verify(args) -> int:
    metadata = read_metadata(args.path)
    storage = storage_for(args.path)
    check_files(storage, metadata)
    base = opened(storage, metadata)  # a delta's base: verified with it, down the chain
    items = [(k, b) for k, t in metadata.tensors.items() for b in t.boxes] + \
            [(k, o) for k, objs in metadata.objects.items() for o in objs]
    unchecked = [(k, i) for k, i in items if not i.crc32c]
    if unchecked:  # a foreign checkpoint: its headers and sizes were checked in reading it
        print(f"UNVERIFIED: {sum(i.nbytes for _, i in unchecked):,} bytes in {len(unchecked)} stored items carry no "
              f"checksum ({getattr(metadata, 'source', '') or 'no checksums recorded'}): their headers, offsets and "
              "file sizes are valid, their contents cannot be verified")
        items = [(k, i) for k, i in items if i.crc32c]
        if not items:
            return 0
    progress = progress_bar(sum(i.nbytes for _, i in items), "verify")
    failures: List[str] = []
    step = metadata.chunk_bytes * 64  # verify in bounded pieces: memory stays small
    for key, item in items:
        for start in range(0, max(item.nbytes, 1), step):
            end = min(start + step, item.nbytes)
            try:
                read_checked(storage, key, item, start, end, metadata.chunk_bytes, base=base)
            except CheckpointError as exc:
                failures.append(str(exc))
                break
            progress.update(end - start)
    progress.close()
    for failure in failures:
        print(f"FAIL: {failure}")
    n = len(items)
    if failures:
        print(f"{len(failures)} of {n} stored items failed verification")
        return 1
    print(f"OK: {n} stored items, {metadata.total_bytes:,} bytes, all checksums match")
    return 0


def cmd_diff(args) -> int:
    report = diff(args.a, args.b, atol=args.atol, rtol=args.rtol, keys=args.keys)
    print(json.dumps(report.to_dict(), indent=1) if args.json else "\n".join(report.lines()))
    return 0 if report.equal else 1


def cmd_list(args) -> int:
    from ._src.manager import CheckpointManager
    manager = CheckpointManager(args.root, prefix=args.prefix)
    latest = manager.latest()
    for step in manager.steps():
        print(f"{manager.name(step)}{'  (latest)' if step == latest else ''}")
    for entry in manager.incomplete():
        print(f"{entry}  INCOMPLETE (remove with: bcp cleanup {args.root})")
    return 0


def cmd_cleanup(args) -> int:
    from ._src.manager import CheckpointManager
    removed = CheckpointManager(args.root, prefix=args.prefix).cleanup()
    for entry in removed:
        print(f"removed {entry} (its save never committed)")
    print(f"{len(removed)} incomplete checkpoint(s) removed; committed ones untouched")
    return 0


def _plot(what: str, draw, png: str) -> None:
    """Draw a PNG, or say which install draws it: the report and trace need no plotting library."""
    try:
        draw(png)
    except MissingDependency as exc:
        print(f"{what}: not drawn ({exc})")
        return
    print(f"{what}: {png}")


def cmd_trace(args) -> int:
    """Report, heatmap and trace of a checkpoint's save; `--history` over a run's root."""
    import os
    from ._src import trace
    from ._src.telemetry import HISTORY_FILE
    storage = storage_for(args.path)
    name = os.path.basename(str(args.path).rstrip("/")) or "checkpoint"
    os.makedirs(args.out, exist_ok=True)
    if args.history:
        if not storage.exists(HISTORY_FILE):
            raise ValueError(f"{storage} has no {HISTORY_FILE}: point --history at a CheckpointManager root")
        rows = trace.read_history(storage.read_bytes(HISTORY_FILE))
        print(trace.history_table(rows))
        _plot("plot", lambda png: trace.history_plot(rows, png), os.path.join(args.out, f"{name}-history.png"))
        return 0
    if not storage.exists(trace.TELEMETRY_FILE):
        hint = (" (it is a run's root: pass --history, or a step directory)" if storage.exists(HISTORY_FILE)
                else " (saves record it unless Checkpointer(telemetry=False))")
        raise ValueError(f"{storage} has no {trace.TELEMETRY_FILE}{hint}")
    doc = trace.load_telemetry(storage)
    print(trace.report(doc))
    out = os.path.join(args.out, f"{name}-trace.json")
    with open(out, "w") as f:
        json.dump(trace.chrome_trace(doc["ranks"]), f)
    print(f"trace: {out}")
    title = f"{doc.get('op', 'save')} of {name}: seconds per rank and phase"
    _plot("heatmap", lambda png: trace.heatmap(doc["ranks"], png, title=title),
          os.path.join(args.out, f"{name}-heatmap.png"))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bcp", description="Inspect and verify ckpt_plugins checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="keys, shapes, dtypes, boxes, bytes, source framework and layout")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--boxes", action="store_true", help="list every stored box")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="check every checksum; exit 1 on any mismatch")
    p.add_argument("path")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("diff", help="compare two checkpoints of any formats and layouts key by key; exit 1 if "
                                    "they differ")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bit for bit)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    p.add_argument("--keys", help="compare only keys matching this glob, e.g. 'model/*experts*'")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_diff)
    for name, func, text in (("list", cmd_list, "committed steps under a run's root, the latest, and incomplete ones"),
                             ("cleanup", cmd_cleanup, "remove step directories whose save never committed "
                                                      "(not those a live save is writing)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("root", help="the run's checkpoint root (CheckpointManager's)")
        p.add_argument("--prefix", default="step_", help="step directory prefix (default step_)")
        p.set_defaults(func=func)
    p = sub.add_parser("trace", help="per-rank, per-phase report of a save (slowest rank, what bound it), "
                                     "heatmap PNG and Perfetto trace; --history over a run")
    p.add_argument("path", help="a checkpoint (its telemetry.json), or with --history a run's root")
    p.add_argument("--out", default=".", help="where the PNG and trace JSON go (default: here)")
    p.add_argument("--history", action="store_true", help="stall, commit time, size, throughput per step")
    p.set_defaults(func=cmd_trace)
    for entry in entry_points(group="ckpt_plugins.commands"):  # framework extensions add theirs
        entry.load()(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ValueError, MissingDependency) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
