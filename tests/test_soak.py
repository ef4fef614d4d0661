"""The fault soak, short (`soak.py`; `bench/soak.py` runs it long): a 4-rank job saving every step
in every mode, to local disk and to S3, through a seeded run of faults of every kind, every
invariant holding after each one."""
import soak


def test_a_short_fault_soak_loses_nothing(tmp_path, s3_server_once):
    report = soak.soak(events=len(soak.KINDS), seed=0, workdir=str(tmp_path), quick=True, server=s3_server_once,
                       log=print)
    assert report.violations == [], "\n".join(report.lines())
    assert set(report.events) == set(soak.KINDS), report.events  # each kind once
    assert report.detected["kill"] and report.detected["disk_full"] and report.detected["corrupt"], report.lines()

