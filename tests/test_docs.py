"""The documentation stays true: the docs site builds with `mkdocs build --strict` (broken links,
missing snippets and API entries fail it), README stays short, and every command README shows runs:
its quick start and its `bcp` lines here, its `torchrun` lines as the examples' own commands
(tests/test_examples.py runs those)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
BIN = os.path.dirname(sys.executable)


def blocks(path: str, language: str) -> list:
    with open(path) as f:
        return re.findall(rf"^```{language}\n(.*?)^```", f.read(), re.S | re.M)


def commands(block: str) -> list:
    """The block's command lines, without their comments."""
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def run(cmd, cwd, **kwargs):
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, **kwargs)
    assert out.returncode == 0, f"{cmd}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_the_docs_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run([os.path.join(BIN, "mkdocs"), "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
        ROOT, env=env)
    with open(tmp_path / "site" / "reference" / "api" / "index.html") as f:
        api = f.read()
    assert "resharding to whatever layout" in api  # the docstrings made it in, not just the headings


def test_readme_is_short_and_its_quick_start_and_cli_lines_run(tmp_path):
    assert os.path.getsize(README) <= 10 * 1024
    quick_start, = [b for b in blocks(README, "python") if "cp.save(" in b]
    run([sys.executable, "-c", quick_start], tmp_path)
    bcp = [line for b in blocks(README, "bash") for line in commands(b) if line.startswith("bcp ")]
    assert {line.split()[1] for line in bcp} >= {"inspect", "verify", "list", "export"}
    for line in bcp:
        argv = line.split()
        run([os.path.join(BIN, argv[0])] + argv[1:], tmp_path)
    assert os.path.exists(tmp_path / "out_dcp" / ".metadata")


def test_every_torchrun_line_in_the_docs_is_an_examples_own_command():
    """README and the guides show the examples' commands; test_examples.py runs exactly those."""
    own = set()
    for name in os.listdir(os.path.join(ROOT, "examples")):
        with open(os.path.join(ROOT, "examples", name)) as f:
            own.update(line.strip() for line in f if line.strip().startswith("torchrun "))
    pages = [README] + [os.path.join(d, f) for d, _, files in os.walk(os.path.join(ROOT, "docs"))
                        for f in files if f.endswith(".md")]
    shown = [line for page in pages for b in blocks(page, "bash") for line in commands(b) if line.startswith("torchrun ")]
    assert shown
    assert set(shown) <= own, set(shown) - own


def test_the_cli_reference_names_every_command():
    out = run([os.path.join(BIN, "bcp"), "--help"], ROOT)
    names = re.search(r"\{([a-z0-9,-]+)\}", out).group(1).split(",")
    with open(os.path.join(ROOT, "docs", "reference", "cli.md")) as f:
        reference = f.read()
    assert [n for n in names if f"`bcp {n} " not in reference] == []
