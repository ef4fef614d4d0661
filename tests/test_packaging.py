"""The package as users install it: `python -m build` makes a wheel and an sdist; the wheel installs
into an environment that already has its own torch (and the frameworks) without touching them,
offline, and the extensions and `bcp` with the extensions' commands work from it."""
from __future__ import annotations

import glob
import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache",
                              ".hypothesis", "*.so", "tests", "bench", "docs")


def run(*cmd):
    # from a directory holding no package: `python -c` puts the working directory first on sys.path
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd="/",
                         timeout=600)
    assert out.returncode == 0, f"{cmd}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_the_wheel_installs_beside_the_users_torch_and_frameworks(tmp_path):
    import torch
    source, dist, env = tmp_path / "src", tmp_path / "dist", tmp_path / "env"
    shutil.copytree(ROOT, source, ignore=SKIP)  # the checkout stays untouched by the build
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, source)
    wheel, = glob.glob(str(dist / "*.whl"))
    sdist, = glob.glob(str(dist / "*.tar.gz"))
    names = zipfile.ZipFile(wheel).namelist()
    for package in ("ckpt_plugins", "ckpt_plugins/_src", "hf_ext", "deepspeed_ext", "megatron_ext"):
        assert f"{package}/__init__.py" in names, package
    with tarfile.open(sdist) as archive:
        assert any(n.endswith("/ckpt_plugins/_hostcopy.c") for n in archive.getnames())
    # the user's environment: a venv that sees this interpreter's packages (its torch, transformers,
    # DeepSpeed) through a path entry, the way a cluster image's site-packages sit below a venv
    run(sys.executable, "-m", "venv", "--without-pip", env)  # its pip and setuptools are the environment's
    python = env / "bin" / "python"
    own_site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    with open(os.path.join(own_site, "users_environment.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    run(python, "-m", "pip", "install", "--no-index", "--no-build-isolation", wheel)  # offline: nothing replaced
    probe = ("import torch, ckpt_plugins, hf_ext, deepspeed_ext, megatron_ext, ckpt_plugins.ext;"
             "print(torch.__version__, torch.__file__, ckpt_plugins.__version__, ckpt_plugins.__file__)")
    version, torch_file, ours, ours_file = run(python, "-c", probe).split()
    assert (version, torch_file) == (torch.__version__, torch.__file__)
    assert ours_file.startswith(own_site) and ours == run(sys.executable, "-c", "import ckpt_plugins;"
                                                          "print(ckpt_plugins.__version__)").strip()
    commands = run(env / "bin" / "bcp", "--help")
    for command in ("inspect", "trace", "import-hf", "import-deepspeed", "import-megatron", "zero-to-fp32"):
        assert command in commands, command
