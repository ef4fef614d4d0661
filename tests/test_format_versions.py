"""Every format version ever written keeps loading: checkpoints written by earlier releases are
shipped in tests/fixtures/format_v<N>/ and load bit for bit into today's code, resharded (two
ranks' rows into one process), and pass `bcp verify`. Version 4's holds compressed boxes; version
5's stores each column in its narrowest width.

A fixture is written once, by the release that introduced its version, and never rewritten:
`python tests/test_format_versions.py tests/fixtures/format_v<N>` (2 ranks). From version 4 on, a
delta checkpoint beside it too: `... tests/fixtures/format_v4 tests/fixtures/format_v4_delta`."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from torch import nn

import ckpt_plugins as cp
from ckpt_plugins.cli import main as bcp
from ckpt_plugins.ext import MODEL, LoadItems, SaveItems, box_fragment, master_key

FIXTURES = Path(__file__).parent / "fixtures"
VERSIONS = [1, 2, 3, 4, 5]
DELTAS = [4, 5]  # versions with a delta checkpoint (format_v<N>_delta, built on format_v<N>)
# denormal, NaN payloads (quiet, signalling), -0.0: values torch.equal cannot tell apart or calls unequal
SPECIALS = torch.tensor([1, 0x7FC00001, 0x7F800001, -(1 << 31)], dtype=torch.int32).view(torch.float32)


def values() -> dict:
    """What every fixture holds (no arithmetic, so any torch gives the same bits)."""
    g = torch.Generator().manual_seed(1)
    return {"rows": torch.randn(6, 5, generator=g), "bf16": torch.randn(3, 4, generator=g).to(torch.bfloat16),
            "ints": torch.arange(-5, 7, dtype=torch.int64), "specials": SPECIALS.clone(),
            "weight": torch.randn(2, 3, generator=g), "exp_avg": torch.randn(2, 3, generator=g),
            "exp_avg_sq": torch.rand(2, 3, generator=g), "master": torch.randn(4, 2, generator=g),
            # from version 4 on, stored compressed: two chunks of int64, and bf16 of few values
            "long": torch.arange(-70_000, 70_000, dtype=torch.int64),
            "smooth": (torch.arange(4096) % 17 - 8).to(torch.bfloat16).view(64, 64)}


class Mixed(cp.Handler):
    """A bf16 weight beside its fp32 master, this rank's rows of it (from version 3 on, stored
    once: the weight as the master's cast)."""

    def __init__(self, master, rank):
        self.master, self.weight, self.rank = master, master.to(torch.bfloat16), rank

    def fragments(self):
        return [box_fragment(f"{MODEL}/mixed", (4, 2), (0, 0), self.weight),
                box_fragment(master_key("mixed"), (4, 2), (2 * self.rank, 0), self.master[2 * self.rank:2 * self.rank + 2])]

    def save_items(self, prefix):
        return SaveItems(fragments=self.fragments())

    def load_items(self, prefix, metadata):
        return LoadItems(fragments=self.fragments())


def model_and_optimizer(v=None):
    model = nn.Linear(3, 2, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    if v is not None:
        with torch.no_grad():
            model.weight.copy_(v["weight"])
        opt.state[model.weight] = {"step": torch.tensor(3.0), "exp_avg": v["exp_avg"].clone(),
                                   "exp_avg_sq": v["exp_avg_sq"].clone()}
    return model, opt


class Rows(cp.Handler):
    """This rank's half of the rows (two ranks wrote the fixture: its tensor is in two boxes)."""

    def __init__(self, tensor, rank):
        self.tensor, self.rank = tensor, rank

    def save_items(self, prefix):
        return SaveItems(fragments=[box_fragment(prefix, (6, 5), (3 * self.rank, 0), self.tensor)])

    def load_items(self, prefix, metadata):
        return LoadItems(fragments=[box_fragment(prefix, (6, 5), (3 * self.rank, 0), self.tensor)])


def changed(v: dict) -> dict:
    """What the delta fixture holds: `long` changed in its second chunk, the rest as it was."""
    v = dict(v, long=v["long"].clone())
    v["long"][-10:] += 1
    return v


def write_fixture(rank, world, path, base=None):
    v = values() if base is None else changed(values())
    model, opt = model_and_optimizer(v)
    cp.save(path, {"model": model, "optim": opt, "rows": Rows(v["rows"][3 * rank:3 * rank + 3], rank),
                   "bf16": v["bf16"], "ints": v["ints"], "specials": v["specials"],
                   "extra": {"epoch": 3, "note": "format fixture"}, "mixed": Mixed(v["master"], rank),
                   "long": v["long"], "smooth": v["smooth"]},
            framework="torch", layout={"dp": world}, step=7, compress=True, delta_from=base)


def test_every_format_version_ever_written_loads_bit_for_bit(tmp_path, capsys):
    for name in [f"format_v{n}" for n in VERSIONS] + [f"format_v{n}_delta" for n in DELTAS]:
        shutil.copytree(FIXTURES / name, tmp_path / name)  # side by side: a delta names its base by relative path
    for version in VERSIONS + [f"{n}_delta" for n in DELTAS]:
        path = tmp_path / f"format_v{version}"
        v = changed(values()) if str(version).endswith("_delta") else values()
        version = int(str(version).split("_")[0])
        meta = cp.read_metadata(str(path))
        assert (meta.version, meta.step, meta.framework, meta.world_size) == (version, 7, "torch", 2)
        model, opt = model_and_optimizer()
        got = {"model": model, "optim": opt, "rows": torch.zeros(6, 5), "bf16": torch.zeros(3, 4, dtype=torch.bfloat16),
               "ints": torch.zeros(12, dtype=torch.int64), "specials": torch.zeros(4), "extra": {"epoch": 0, "note": ""}}
        if version >= 3:
            got["mixed"] = Mixed(torch.zeros(4, 2), 0)
            got["mixed"].weight.zero_()
        if version >= 4:
            got["long"], got["smooth"] = torch.zeros_like(v["long"]), torch.zeros_like(v["smooth"])
            long = meta.tensors["long"].boxes[0]
            assert len(long.packed) == 2 and long.delta == (meta.delta is not None)
            if meta.delta is not None:  # only the changed chunk is stored
                assert meta.delta.path == f"../format_v{version}" and long.packed[0] == 0 < long.packed[1]
        cp.load(str(path), got)
        for key in ("rows", "bf16", "ints"):
            assert torch.equal(got[key], v[key]), (version, key)
        assert torch.equal(got["specials"].view(torch.int32), SPECIALS.view(torch.int32)), version
        assert torch.equal(model.weight, v["weight"])
        state = opt.state[model.weight]
        assert state["step"].item() == 3.0
        assert torch.equal(state["exp_avg"], v["exp_avg"]) and torch.equal(state["exp_avg_sq"], v["exp_avg_sq"])
        assert got["extra"] == {"epoch": 3, "note": "format fixture"}
        if version >= 4:
            assert torch.equal(got["long"], v["long"]) and torch.equal(got["smooth"], v["smooth"])
        if version >= 3:  # the weight: the master's rows of both ranks, cast
            assert meta.casts == {f"{MODEL}/mixed": master_key("mixed")}
            assert torch.equal(got["mixed"].weight, v["master"].to(torch.bfloat16))
            assert torch.equal(got["mixed"].master[:2], v["master"][:2])
        assert bcp(["verify", str(path)]) == 0, capsys.readouterr()


if __name__ == "__main__":
    from distributed import run_ranks
    run_ranks(2, write_fixture, sys.argv[1])
    if len(sys.argv) > 2:
        run_ranks(2, write_fixture, sys.argv[2], sys.argv[1])
