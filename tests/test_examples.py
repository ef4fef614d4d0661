"""The examples run as their docstrings say: the two torchrun commands each example's docstring
gives (train steps 1-4 on 2 processes and save; resume on 1 process and train to step 6) are run
as written, with only the rendezvous and the checkpoint directory changed, and the resumed run
must start from the saved weights and step."""
import ast
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

from distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TIMEOUT = 300  # seconds per command; each takes about 10 here

# (example name, whether it runs under the tests' Megatron CPU shim): examples/<name>.py
EXAMPLES = [
    ("fsdp2_loop", False),
    ("accelerate_loop", False),
    ("hf_trainer", False),
    ("deepspeed_zero", False),
    ("megatron_gpt", True),  # Megatron calls CUDA; on CPU the shim redirects those calls
]
LAUNCHER = os.path.join(ROOT, "tests", "megatron_launch.py")


def docstring_commands(name: str) -> list:
    """The torchrun lines of examples/<name>.py's docstring, checked against the contract."""
    with open(os.path.join(ROOT, "examples", f"{name}.py")) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    lines = [line.strip() for line in doc.splitlines() if line.strip().startswith("torchrun")]
    expected = [f"torchrun --standalone --nproc-per-node {procs} examples/{name}.py --ckpt-dir /tmp/ckpt_{name} "
                f"--steps {steps}" for procs, steps in ((2, 4), (1, 6))]
    assert lines == expected, f"examples/{name}.py's docstring must give these two commands: {expected}, not {lines}"
    return lines


def run(line: str, name: str, ckpt_dir: str, shim: bool) -> str:
    """Run one docstring command; its combined output. A failure shows the output's tail."""
    args = []
    for word in shlex.split(line):
        if word == "torchrun":
            args.append(TORCHRUN)
        elif word == "--standalone":
            args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        elif word == f"/tmp/ckpt_{name}":
            args.append(ckpt_dir)
        elif word == f"examples/{name}.py" and shim:
            args += [LAUNCHER, word]
        else:
            args.append(word)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # a session of its own: on a timeout the ranks torchrun started are killed with it
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{line} did not finish in {TIMEOUT} s; its output ends with:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{line} exited with {proc.returncode}; its output ends with:\n{out[-4000:]}"
    return out


def report(out: str) -> dict:
    """The lines rank 0 prints, by kind."""
    return {"resumed": re.findall(r"^resumed at step (\d+) on (\d+) processes$", out, re.M),
            "eval": [float(v) for v in re.findall(r"^eval loss (\S+)$", out, re.M)],
            "steps": [int(s) for s in re.findall(r"^step (\d+) loss \S+$", out, re.M)],
            "saved": [int(s) for s in re.findall(r"^saved step (\d+)$", out, re.M)]}


@pytest.mark.parametrize("name, shim", EXAMPLES, ids=[name for name, _ in EXAMPLES])
def test_example_trains_saves_and_resumes_on_another_process_count(name, shim, tmp_path):
    first, second = docstring_commands(name)
    ckpt_dir = str(tmp_path / "ckpt")
    trained = report(run(first, name, ckpt_dir, shim))
    assert trained["resumed"] == [] and trained["steps"] == [1, 2, 3, 4] and trained["saved"] == [4], trained
    assert trained["eval"], trained

    resumed = report(run(second, name, ckpt_dir, shim))
    assert resumed["resumed"] == [("4", "1")], resumed
    # the weights came back: the held-out batch's loss is the saved run's, bit for bit (both are
    # computed on the whole batch by every process, so the process count does not enter)
    assert resumed["eval"][0] == trained["eval"][-1], (resumed["eval"], trained["eval"])
    assert resumed["steps"] == [5, 6] and resumed["saved"] == [6], resumed
