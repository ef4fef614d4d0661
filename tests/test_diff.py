"""`bcp diff` and `cp.diff`: two checkpoints of different layouts (the format-1 fixture, written by
2 ranks, and a 1-process save of the same values) compare equal; one changed element is named
with its key, index and stored box; a removed key is reported missing; a live state compares
with a checkpoint."""
import json
import shutil

import pytest
import torch

import ckpt_plugins as cp
from ckpt_plugins.cli import main as bcp
from test_format_versions import FIXTURES, model_and_optimizer, values


def save_values(path, change=None, drop=()):
    v = values()
    if change:
        change(v)
    model, opt = model_and_optimizer(v)
    state = {"model": model, "optim": opt, "rows": v["rows"], "bf16": v["bf16"], "ints": v["ints"],
             "specials": v["specials"], "extra": {"epoch": 3, "note": "format fixture"}}
    cp.save(path, {k: s for k, s in state.items() if k not in drop})


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory):
    path = tmp_path_factory.mktemp("diff") / "fixture"
    shutil.copytree(FIXTURES / "format_v1", path)
    return str(path)


def test_the_same_values_in_another_layout_are_equal(two_rank, tmp_path, capsys):
    save_values(tmp_path / "one")
    assert bcp(["diff", two_rank, str(tmp_path / "one"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["equal"] and report["counts"]["equal"] == len(report["keys"]) == 11
    assert {k["key"] for k in report["keys"]} >= {"rows", "specials", "optim/weight/exp_avg", "optim/param_groups"}


def test_one_changed_element_is_named_with_its_key_index_and_box(two_rank, tmp_path, capsys):
    def change(v):
        v["rows"][4, 2] = v["rows"][4, 2] + 0.5
    save_values(tmp_path / "changed", change)
    assert bcp(["diff", two_rank, str(tmp_path / "changed")]) == 1
    out = capsys.readouterr().out
    assert "10 equal" in out and "1 different" in out
    assert "different  rows: max abs 0.5, max rel" in out
    assert "1 of 30 elements; first at [4, 2] in box at [3, 0] of [3, 5]" in out
    streamed = cp.diff(two_rank, tmp_path / "changed", keys="rows", slab_bytes=64).keys[0]  # one row per slab
    assert (streamed.first_index, streamed.first_box, streamed.differing) == (
        [4, 2], {"offsets": [3, 0], "lengths": [3, 5]}, 1)
    assert bcp(["diff", two_rank, str(tmp_path / "changed"), "--atol", "0.6"]) == 0  # within tolerance
    assert bcp(["diff", two_rank, str(tmp_path / "changed"), "--keys", "optim/*"]) == 0  # rows not compared
    capsys.readouterr()


def test_a_removed_key_is_missing_on_its_side(two_rank, tmp_path, capsys):
    save_values(tmp_path / "fewer", drop=("ints",))
    assert bcp(["diff", two_rank, str(tmp_path / "fewer")]) == 1
    assert "only in a  ints" in capsys.readouterr().out
    assert [k.key for k in cp.diff(tmp_path / "fewer", two_rank).keys if k.status == "only in b"] == ["ints"]


def test_a_live_state_compares_with_a_checkpoint(two_rank):
    v = values()
    model, opt = model_and_optimizer(v)
    state = {"model": model, "optim": opt, "rows": v["rows"], "ints": v["ints"]}
    report = cp.diff(two_rank, state, keys="[mor]*")
    assert report.equal and len(report.keys) == 6  # weight, its moments and step, param groups, rows
    with torch.no_grad():
        model.weight[1, 0] = float("nan")
    different = cp.diff(two_rank, state).keys[0]
    assert (different.key, different.first_index, different.first_box) == (
        "model/weight", [1, 0], {"offsets": [0, 0], "lengths": [2, 3]})
    assert different.max_abs == float("inf")
