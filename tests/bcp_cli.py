"""The `bcp` command run in the test's own process: its exit status and output, without a new
interpreter's seconds of imports. Its console script runs as a command in test_cli and
test_packaging."""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def bcp(*args, check: bool = True) -> Ran:
    """`bcp ARGS...`; with `check`, a non-zero exit fails the test, showing its stderr."""
    from ckpt_plugins.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
    ran = Ran(code, out.getvalue(), err.getvalue())
    if check:
        assert ran.returncode == 0, ran.stderr
    return ran
