"""`bcp inspect` and `bcp verify`, run through the installed console script."""
import json
import os
import subprocess
import sys

import torch
from torch import nn

import ckpt_plugins as cp

BCP = os.path.join(os.path.dirname(sys.executable), "bcp")


def bcp(*args):
    return subprocess.run([BCP, *map(str, args)], capture_output=True, text=True, timeout=120)


def make(path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    cp.save(path, {"model": m, "extra": {"epoch": 2}}, framework="torch", layout={"dp": 1}, step=11)


def test_inspect_text_and_json(tmp_path):
    make(tmp_path / "c")
    out = bcp("inspect", tmp_path / "c", "--boxes")
    assert out.returncode == 0, out.stderr
    assert "from torch" in out.stdout and "step 11" in out.stdout
    assert "model/0.weight" in out.stdout and "(6, 4)" in out.stdout and "float32" in out.stdout
    assert "offsets [0, 0] lengths [6, 4]" in out.stdout and "extra/epoch" in out.stdout
    info = json.loads(bcp("inspect", tmp_path / "c", "--json").stdout)
    assert info["status"] == "committed" and info["step"] == 11 and info["layout"] == {"dp": 1}
    assert info["tensors"]["model/1.bias"] == {
        "shape": [2], "dtype": "float32", "bytes": 8, "stored_bytes": 8,
        "boxes": [{**{k: v for k, v in info["tensors"]["model/1.bias"]["boxes"][0].items()},
                   "offsets": [0], "lengths": [2], "nbytes": 8}]}
    assert info["total_bytes"] == sum(os.path.getsize(tmp_path / "c" / f) for f in info["files"])


def test_inspect_reports_incomplete(tmp_path):
    make(tmp_path / "c")
    os.remove(tmp_path / "c" / "metadata.json")
    out = bcp("inspect", tmp_path / "c")
    assert out.returncode == 2 and "INCOMPLETE" in out.stdout and "never committed" in out.stdout
    assert json.loads(bcp("inspect", tmp_path / "c", "--json").stdout)["status"] == "incomplete"


def test_verify_passes_then_names_the_corrupt_key_and_file(tmp_path):
    make(tmp_path / "c")
    out = bcp("verify", tmp_path / "c")
    assert out.returncode == 0 and "all checksums match" in out.stdout
    meta = cp.read_metadata(tmp_path / "c")
    box = meta.tensors["model/1.weight"].boxes[0]
    with open(tmp_path / "c" / box.file, "r+b") as f:
        f.seek(box.offset + box.nbytes - 1)
        f.write(b"\xff")
    out = bcp("verify", tmp_path / "c")
    assert out.returncode == 1
    assert f"checksum mismatch in model/1.weight: file {box.file}" in out.stdout
    assert "1 of 5 stored items failed" in out.stdout


def test_cli_errors_are_one_clear_line(tmp_path):
    out = bcp("verify", tmp_path / "nothing")
    assert out.returncode == 1 and out.stderr.startswith("error: ") and "is not a checkpoint ckpt_plugins reads" in out.stderr


def without(*modules):
    """`bcp` in a Python where `modules` are not installed (an import of them fails as if absent)."""
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in modules)
    return [sys.executable, "-c", f"import sys; {blocked}; from ckpt_plugins.cli import main; sys.exit(main(sys.argv[1:]))"]


def test_a_missing_optional_dependency_is_one_line_naming_its_install(tmp_path, monkeypatch):
    from ckpt_plugins.ext import MissingDependency
    out = subprocess.run([*without("s3fs"), "inspect", "s3://bucket/ckpt"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error: s3://bucket/ckpt needs s3fs") and "pip install 'ckpt_plugins[s3]'" in out.stderr
    import deepspeed_ext
    import megatron_ext.training
    for module, call, install in (("deepspeed", deepspeed_ext.initialize, "'ckpt_plugins[deepspeed]'"),
                                  ("deepspeed", deepspeed_ext.install, "'ckpt_plugins[deepspeed]'"),
                                  ("megatron", megatron_ext.training.install, "megatron-core")):
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, module, None)
            try:
                call()
                raise AssertionError(f"{call.__qualname__} ran without {module}")
            except MissingDependency as exc:
                assert str(exc).startswith(f"{call.__module__.split('.')[0]} needs {module}") and install in str(exc)
                assert isinstance(exc, ModuleNotFoundError) and exc.name == module


def test_an_installed_package_that_fails_to_import_keeps_its_own_error(tmp_path, monkeypatch):
    from ckpt_plugins.ext import MissingDependency, require
    (tmp_path / "half_installed.py").write_text("import a_module_nobody_has\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        require("half_installed", "a feature")
        raise AssertionError("imported")
    except ModuleNotFoundError as exc:
        assert not isinstance(exc, MissingDependency) and exc.name == "a_module_nobody_has"


def test_a_framework_version_outside_the_supported_range_is_refused_naming_it(monkeypatch):
    import deepspeed_ext
    import hf_ext.accelerate
    import hf_ext.trainer
    import megatron_ext.training
    from ckpt_plugins._src import optional
    from ckpt_plugins.ext import UnsupportedVersion
    for distribution, call, found, supported in (
            ("deepspeed", deepspeed_ext.initialize, "0.18.5", ">=0.19,<0.20"),
            ("megatron-core", megatron_ext.training.install, "0.20.0rc1", ">=0.19,<0.20"),
            ("transformers", lambda: hf_ext.trainer.enable(None), "4.57.1", ">=5,<6"),
            ("accelerate", lambda: hf_ext.accelerate.enable(None), "2.0.0", ">=1.1,<2")):
        monkeypatch.setattr(optional, "installed_version", lambda name, module: found if name == distribution else "0")
        try:
            call()
            raise AssertionError(f"{distribution} {found} accepted")
        except UnsupportedVersion as exc:
            assert f"supports {distribution} {supported}; {found} is installed" in str(exc)


def test_a_source_checkout_without_metadata_is_checked_by_its_version_attribute(tmp_path, monkeypatch):
    from ckpt_plugins.ext import UnsupportedVersion, require_version
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, text in (("old_checkout", "__version__ = '0.18.2'\n"), ("unversioned_checkout", "")):
        (tmp_path / f"{name}.py").write_text(text)
    try:  # no distribution metadata: a checkout on PYTHONPATH, as Megatron-LM often is
        require_version("old_checkout", "old-checkout", ("0.19", "0.20"), "an extension")
        raise AssertionError("0.18.2 accepted")
    except UnsupportedVersion as exc:
        assert "supports old-checkout >=0.19,<0.20; 0.18.2 is installed" in str(exc)
    assert require_version("unversioned_checkout", "unversioned-checkout", ("0.19", "0.20"), "an extension")
