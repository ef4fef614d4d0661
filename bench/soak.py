"""The randomized fault soak, long: `python bench/soak.py --events 300 --seed 1`.

A 4-rank training job saving every step (sync, async, overlapped, memory tier; local disk and an
S3 server in turn) through a seeded schedule of faults: killed ranks, a full disk, S3 connections
cut, a corrupt committed byte, a frozen rank, a lost host with its memory tier. Restarted as
torchrun's elastic agent would, sometimes on fewer ranks, and checked after every event (see
tests/soak.py). Prints the events survived by fault kind and every broken invariant; exits 1 if
any broke. Everything it writes goes to a temporary directory it removes.
"""
import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import soak  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-s3", action="store_true", help="local disk only (no SeaweedFS server)")
    parser.add_argument("--dir", default=None, help="where the run writes (default: a temp dir)")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="ckpt_soak_", dir=args.dir)
    try:
        report = soak.soak(args.events, args.seed, workdir, s3=not args.no_s3, log=print)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n".join(report.lines()))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
