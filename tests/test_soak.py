"""The fault soak, short (`soak.py`; `bench/soak.py` runs it long): a 4-rank job saving every step
in every mode, to local disk and to S3, through a seeded run of faults of every kind, every
invariant holding after each one."""
import os
import signal
import time

import soak


def test_a_short_fault_soak_loses_nothing(tmp_path, s3_server_once):
    report = soak.soak(events=len(soak.KINDS), seed=0, workdir=str(tmp_path), quick=True, server=s3_server_once,
                       log=print)
    assert report.violations == [], "\n".join(report.lines())
    assert set(report.events) == set(soak.KINDS), report.events  # each kind once
    assert report.detected["kill"] and report.detected["disk_full"] and report.detected["corrupt"], report.lines()



def test_the_watchdog_restarts_a_server_that_stopped_answering_and_keeps_its_data(s3_server_once):
    """A stopped SeaweedFS still accepts connections: the soak's health check restarts it on its
    data and points the proxy at it."""
    import s3_server
    server, proxy = s3_server_once, s3_server.CuttingProxy(s3_server_once.port)
    fs = s3_server.client(f"http://127.0.0.1:{proxy.port}")
    fs.pipe_file("ckpt/watchdog/kept", b"before the restart")
    stopped, report, seen = server.process, soak.Report(seed=0), []
    os.killpg(stopped.pid, signal.SIGSTOP)
    watchdog = soak.Watchdog(server, proxy, report, seen.append, every=0.5, timeout=1.0)
    try:
        deadline = time.time() + 60
        while report.restarts == 0 and time.time() < deadline:
            time.sleep(0.2)
        assert report.restarts == 1 and "did not answer 2 probes" in seen[0], seen
        assert stopped.poll() is not None and server.process is not stopped
        assert fs.cat_file("ckpt/watchdog/kept") == b"before the restart"  # through the proxy: the new server
    finally:
        watchdog.close()
        proxy.close()


def test_the_proxy_goes_on_after_its_server_refused_a_connection(s3_server_once):
    """While the watchdog restarts the server, a connection finds nothing upstream: that client is
    reset, and later ones reach the new server."""
    import socket

    import s3_server
    from distributed import free_port
    proxy = s3_server.CuttingProxy(free_port())  # nothing listens there
    try:
        try:
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as refused:
                assert refused.recv(1) == b""
        except ConnectionResetError:
            pass  # reset at once: on a busy machine the reset can reach connect() itself
        proxy.upstream = s3_server_once.port
        fs = s3_server.client(f"http://127.0.0.1:{proxy.port}")
        fs.pipe_file("ckpt/watchdog/after_refusal", b"reached")
        assert fs.cat_file("ckpt/watchdog/after_refusal") == b"reached"
    finally:
        proxy.close()


def test_the_proxy_closes_the_connections_that_ended(s3_server_once):
    """A 300-event soak opens thousands of connections through the proxy: an ended one keeps no
    file descriptor."""
    import socket

    import s3_server
    proxy = s3_server.CuttingProxy(s3_server_once.port)
    before = len(os.listdir("/proc/self/fd"))
    try:
        for _ in range(40):
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as conn:
                conn.sendall(b"GET /ckpt/ready HTTP/1.0\r\n\r\n")  # refused (no signature); the server closes
                assert conn.recv(12).startswith(b"HTTP/1.")
                while conn.recv(65536):
                    pass
        deadline = time.time() + 10
        while proxy.conns and time.time() < deadline:
            time.sleep(0.05)
        assert proxy.conns == {} and len(os.listdir("/proc/self/fd")) <= before + 2
    finally:
        proxy.close()
