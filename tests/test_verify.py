"""A verified load (`load(..., verify=True)`) catches what checksums cannot: the live state after the
load differing from what was loaded. Each test breaks one thing on purpose (a mapping swapped for
two experts, a wrong box, a cast after the load, a tensor the load filled but the model never
adopted): the plain load passes it unnoticed, the verified one names the key, the box and the rank.
A resharded, verified load runs in test_reshard.py."""
import pytest
import torch
from torch import nn

import ckpt_plugins as cp
from ckpt_plugins._src.fragment import Fragment
from ckpt_plugins._src.state import ModuleHandler


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 2, bias=False)
        self.experts = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(2))

    def forward(self, x):
        weights = self.router(x).softmax(-1)
        return sum(weights[:, e:e + 1] * expert(x) for e, expert in enumerate(self.experts))


def trained(seed):
    torch.manual_seed(seed)
    model = MoE()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).square().sum().backward()
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("verify") / "ckpt"
    model, opt = trained(0)
    cp.save(path, {"model": model, "optim": opt})
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def break_load(monkeypatch, breakage):
    """The modules' load side broken by `breakage(items)`; their save side (what verify reads) intact."""
    original = ModuleHandler.load_items

    def broken(self, prefix, metadata):
        items = original(self, prefix, metadata)
        breakage(items)
        return items
    monkeypatch.setattr(ModuleHandler, "load_items", broken)


def frag(items, name):
    return next(f for f in items.fragments if f.key == f"model/{name}")


def swap_experts(items):
    a, b = frag(items, "experts.0.weight"), frag(items, "experts.1.weight")
    a.key, b.key = b.key, a.key


def wrong_box(items):  # rows 0-1 filled from the stored rows 2-3 and the other way round
    f = frag(items, "router.weight")
    items.fragments.remove(f)
    items.fragments += [Fragment(f.key, f.global_shape, f.dtype, (1, 0), f.local[:1]),
                        Fragment(f.key, f.global_shape, f.dtype, (0, 0), f.local[1:])]


def cast_after(items):  # a post-load step rounding the weights through bf16
    f = frag(items, "experts.1.weight")
    items.finish.append(lambda: f.local.copy_(f.local.to(torch.bfloat16)))


def not_adopted(items):  # filled a copy the model never takes up
    f = frag(items, "experts.0.weight")
    f.local = f.local.clone()


@pytest.mark.parametrize("breakage, key, box", [
    (swap_experts, "model/experts.1.weight", "box at [0, 0] of [4, 4]"),
    (wrong_box, "model/router.weight", "box at [1, 0] of [1, 4]"),
    (cast_after, "model/experts.1.weight", "box at [0, 0] of [4, 4]"),
    (not_adopted, "model/experts.0.weight", "box at [0, 0] of [4, 4]"),
], ids=["mapping swapped for two experts", "wrong box", "cast after the load", "stale tensor"])
def test_verify_catches_what_a_plain_load_lets_through(saved, monkeypatch, breakage, key, box):
    path, expected = saved
    break_load(monkeypatch, breakage)
    model, opt = trained(1)
    cp.load(path, {"model": model, "optim": opt})  # passes: nothing a checksum sees is wrong
    assert any(not torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    model, opt = trained(1)
    with pytest.raises(cp.VerificationError) as err:
        cp.load(path, {"model": model, "optim": opt}, verify=True)
    assert f"{key}, {box}, rank 0" in str(err.value)


def test_a_verified_load_of_a_sound_state_passes_and_counts_what_it_compared(saved):
    path, expected = saved
    model, opt = trained(1)
    result = cp.load(path, {"model": model, "optim": opt}, verify=True)
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    weights = sum(v.numel() * 4 for v in expected.values())
    assert result.verified_bytes == 3 * weights + 3 * 4  # weights, two moments, three step counts
    assert result.telemetry.phase("verify").seconds > 0


def test_an_optimizer_resumed_without_some_experts_state_names_them(tmp_path):
    """Experts whose optimizer state never arrived (left out of the save, as with EP ranks that did
    not save theirs) are missing keys, not moments silently restarted from zero."""
    model, _ = trained(0)
    partial = torch.optim.AdamW([model.router.weight, model.experts[0].weight], lr=0.1)
    model(torch.randn(3, 4)).square().sum().backward()
    partial.step()
    cp.save(tmp_path / "c", {"model": model, "optim": partial})
    model, opt = trained(1)
    with pytest.raises(cp.LoadMismatchError, match="keys missing from the checkpoint: optim/experts.1.weight/exp_avg"):
        cp.load(tmp_path / "c", {"model": model, "optim": opt})
    assert cp.load(tmp_path / "c", {"model": model, "optim": opt}, strict=False).missing_keys == [
        f"optim/experts.1.weight/{s}" for s in ("exp_avg", "exp_avg_sq", "step")]
