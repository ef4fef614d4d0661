"""save/load in one process: modules, optimizers, schedulers, objects, tied weights, strictness."""
import base64
import json
import os
import threading

import numpy as np
import pytest
import torch
from torch import nn

import ckpt_plugins as cp
from ckpt_plugins.cli import main as bcp


class TinyLM(nn.Module):
    def __init__(self, vocab=32, dim=16, tied=True):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = torch.relu(layer(h)) + h
        return self.lm_head(self.norm(h))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 32, (4, 8), generator=g)


def train_step(model, opt, sched, step):
    ids = batch(step)
    loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def make(seed, tied=True, groups=None):
    torch.manual_seed(seed)
    model = TinyLM(tied=tied)
    params = groups(model) if groups else model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=10)
    return model, opt, sched


def test_resume_continues_training_bit_for_bit(tmp_path):
    model, opt, sched = make(0)
    for step in range(3):
        train_step(model, opt, sched, step)
    rng = torch.get_rng_state()
    state = {"model": model, "optim": opt, "sched": sched,
             "extra": {"step": 3, "note": ("tuple", 1), "rng": cp.PerRank(rng)}}
    info = cp.save(tmp_path / "ckpt", state, step=3)
    assert info.total_bytes > 0 and info.collectives == 0
    expected = [train_step(model, opt, sched, step) for step in range(3, 6)]

    model2, opt2, sched2 = make(1)
    extra = {"step": 0, "note": None, "rng": cp.PerRank(None)}
    result = cp.load(tmp_path / "ckpt", {"model": model2, "optim": opt2, "sched": sched2, "extra": extra})
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert extra["step"] == 3 and extra["note"] == ("tuple", 1) and torch.equal(extra["rng"].value, rng)
    assert sched2.last_epoch == 3
    assert opt2.param_groups[0]["betas"] == (0.9, 0.999)
    resumed = [train_step(model2, opt2, sched2, step) for step in range(3, 6)]
    assert resumed == expected
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)


def test_a_load_makes_the_collector_scan_no_heap_and_leaves_it_on(tmp_path):
    """A load's many small objects (fragments, plans, read jobs) die with it: the cyclic garbage
    collector stays paused through it, where each of its passes would scan a training job's whole
    heap (0.2 s of a 200M-parameter Megatron load), and is on again afterwards."""
    import gc
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(300)])
    path = str(tmp_path / "c")
    cp.save(path, {"model": model})
    fresh = nn.Sequential(*[nn.Linear(4, 4) for _ in range(300)])
    passes = []

    def seen(phase, info):
        if phase == "start":
            passes.append(info["generation"])
    gc.collect()
    gc.callbacks.append(seen)
    try:
        cp.load(path, {"model": fresh})
    finally:
        gc.callbacks.remove(seen)
    assert passes == [] and gc.isenabled()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_tied_weights_are_stored_once_and_load_tied_or_untied(tmp_path):
    model, opt, sched = make(0, tied=True)
    cp.save(tmp_path / "c", {"model": model})
    meta = cp.read_metadata(tmp_path / "c")
    assert meta.aliases == {"model/lm_head.weight": "model/embed_tokens.weight"}
    assert "model/lm_head.weight" not in meta.tensors
    untied, _, _ = make(1, tied=False)
    cp.load(tmp_path / "c", {"model": untied})
    assert torch.equal(untied.lm_head.weight, model.embed_tokens.weight)
    tied, _, _ = make(2, tied=True)
    cp.load(tmp_path / "c", {"model": tied})
    assert torch.equal(tied.lm_head.weight, model.embed_tokens.weight)


def test_optimizer_state_is_keyed_by_name_not_position(tmp_path):
    model, opt, sched = make(0)
    train_step(model, opt, sched, 0)
    cp.save(tmp_path / "c", {"model": model, "optim": opt})
    meta = cp.read_metadata(tmp_path / "c")
    assert "optim/layers.1.weight/exp_avg" in meta.tensors and "optim/param_groups" in meta.objects

    def regroup(m):  # other order, other grouping: names still match
        ps = list(m.named_parameters())[::-1]
        return [{"params": [p for n, p in ps if "layers" in n]}, {"params": [p for n, p in ps if "layers" not in n]}]

    model2, opt2, _ = make(1, groups=regroup)
    cp.load(tmp_path / "c", {"model": model2, "optim": opt2})
    names2 = {p: n for n, p in model2.named_parameters()}
    names1 = {n: p for n, p in model.named_parameters()}
    for p2, st2 in opt2.state.items():
        st1 = opt.state[names1[names2[p2]]]
        assert sorted(st1) == sorted(st2)
        for k in st1:
            assert torch.equal(st1[k], st2[k])
    assert all(g["lr"] == opt.param_groups[0]["lr"] for g in opt2.param_groups)


def test_strict_names_missing_and_unexpected_keys(tmp_path):
    model, opt, sched = make(0)
    cp.save(tmp_path / "c", {"model": model, "extra": {"a": 1}})
    model2, _, _ = make(1)
    model2.extra = nn.Linear(2, 2)
    before = model2.embed_tokens.weight.clone()
    with pytest.raises(cp.LoadMismatchError) as err:
        cp.load(tmp_path / "c", {"model": model2, "extra": {"b": 2}})
    message = str(err.value)
    assert "model/extra.weight" in message and "model/extra.bias" in message and "extra/b" in message
    assert "extra/a" in message and "strict=False" in message
    assert torch.equal(model2.embed_tokens.weight, before)  # nothing touched
    extra = {"b": 2}
    result = cp.load(tmp_path / "c", {"model": model2, "extra": extra}, strict=False)
    assert result.missing_keys == ["extra/b", "model/extra.bias", "model/extra.weight"]
    assert result.unexpected_keys == ["extra/a"]
    assert torch.equal(model2.embed_tokens.weight, model.embed_tokens.weight)


def test_save_refuses_to_clobber_a_committed_checkpoint(tmp_path):
    model, _, _ = make(0)
    cp.save(tmp_path / "c", {"model": model})
    with pytest.raises(cp.SaveError, match="already holds a committed checkpoint"):
        cp.save(tmp_path / "c", {"model": model})
    with torch.no_grad():
        model.norm.weight.fill_(3.0)
    cp.save(tmp_path / "c", {"model": model}, overwrite=True)
    model2, _, _ = make(1)
    cp.load(tmp_path / "c", {"model": model2})
    assert torch.equal(model2.norm.weight, torch.full((16,), 3.0))


def test_objects_json_when_plain_and_safe_torch_otherwise(tmp_path):
    extra = {"plain": {"lr": [1.5, 2], "name": "x"}, "tensors": [torch.arange(3)], "tuple": (1, 2)}
    cp.save(tmp_path / "c", {"extra": extra})
    meta = cp.read_metadata(tmp_path / "c")
    # nested dicts recurse into keys; a dict wanted as a placeholder is rebuilt from them
    assert [meta.objects[k][0].encoding for k in ("extra/plain/lr", "extra/plain/name", "extra/tensors",
                                                  "extra/tuple")] == ["json", "json", "torch", "torch"]
    back = {"plain": None, "tensors": None, "tuple": None}
    cp.load(tmp_path / "c", {"extra": back})
    assert back["plain"] == extra["plain"] and back["tuple"] == (1, 2)
    assert torch.equal(back["tensors"][0], torch.arange(3))


class Opaque:
    pass


def test_unsafe_objects_are_refused_at_save(tmp_path):
    with pytest.raises(cp.SaveError, match="Opaque is neither JSON data nor"):
        cp.save(tmp_path / "c", {"extra": {"o": Opaque()}})
    assert not os.path.exists(tmp_path / "c" / "metadata.json")


def test_objects_made_of_what_weights_only_rebuilds_are_not_loaded_back_at_save(monkeypatch):
    from ckpt_plugins._src.objects import decode_object, encode_object
    plain = [[{"params": [0, 1], "betas": (0.9, 0.999), "lr": float("nan")}],
             {1: torch.arange(3), "raw": b"ab", "c": 1j, "none": None}, torch.zeros(2, dtype=torch.uint8)]
    tagged = torch.ones(2)
    tagged.note = "kept"  # pickled with the tensor: checked by loading it back
    other = [torch.nn.Parameter(torch.ones(2)), torch.Size([2, 3]), tagged]
    real, loads = torch.load, []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(1) or real(*a, **k))
    encoded = [encode_object(v) for v in plain]
    assert loads == []  # no round trip: these are known to load
    encoded += [encode_object(v) for v in other]
    assert len(loads) == len(other)  # anything else is checked by loading it back
    with pytest.raises(TypeError, match="(?s)list is neither JSON data nor .*Unsupported global: GLOBAL .*Opaque"):
        encode_object([{"o": Opaque()}])
    for value, enc in zip(plain + other, encoded):
        back = decode_object("k", enc.encoding, enc.data)
        assert type(back) is type(value) and repr(back) == repr(value)
        assert getattr(back, "__dict__", None) == getattr(value, "__dict__", None)
    tagged.note = Opaque()
    with pytest.raises(TypeError, match="(?s)Tensor is neither JSON data nor .*Opaque"):
        encode_object(tagged)


def test_a_writer_is_woken_once_its_piece_is_staged_not_for_every_tensor_copied(tmp_path, monkeypatch):
    """And a small save's one file is written by the commit thread: no writer thread is started."""
    from ckpt_plugins._src.engine import write
    wakes, started, start = [], [], threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self.name) or start(self))

    class Counted(threading.Condition):
        def notify_all(self):
            wakes.append(1)
            super().notify_all()
    init = write.StagedWrite.__init__

    def counted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._cond = Counted()
    monkeypatch.setattr(write.StagedWrite, "__init__", counted)
    state = {f"w{i}": torch.full((8,), float(i)) for i in range(300)}
    cp.save(tmp_path / "c", {"t": state})
    assert len(wakes) < 10  # the snapshot's start and end, the writer's piece, its window written
    assert not [n for n in started if n.startswith("ckpt-write")], started
    back = {k: torch.zeros(8) for k in state}
    cp.load(tmp_path / "c", {"t": back})
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_metadata_is_versioned_plain_json(tmp_path):
    model, _, _ = make(0)
    cp.save(tmp_path / "c", {"model": model}, framework="torch", layout={"dp": 1}, step=7)
    raw = json.loads((tmp_path / "c" / "metadata.json").read_text())
    assert raw["format"] == "ckpt_plugins" and raw["version"] == 5 and raw["step"] == 7
    # the tensor table's columns, read as the format specification says, with numpy alone: each
    # in the narrowest width its values fit (shape: 16, and the others' dims, in a byte)
    names = ("ndim", "shape", "dtype")
    types = raw["column_types"]["tensors"]
    assert [types[name] for name in names] == ["uint8"] * 3
    column = {name: np.frombuffer(base64.b64decode(raw["tensors"][name]), dtype=np.dtype(types[name]).newbyteorder("<"))
              for name in names}
    i = raw["keys"].index("model/norm.weight")
    start = int(column["ndim"][:i].sum())
    assert column["shape"][start:start + column["ndim"][i]].tolist() == [16]
    assert raw["dtypes"][column["dtype"][i]] == "float32"


def test_fp32_model_loads_the_masters_of_a_mixed_precision_checkpoint(tmp_path):
    model, _, _ = make(0, tied=False)
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    low = make(0, tied=False)[0].to(torch.bfloat16)  # bf16 weights + fp32 masters, as a mixed-precision job
    cp.save(tmp_path / "c", {"model": low, "optim": {n: {"master": m} for n, m in masters.items()}})
    fp32, _, _ = make(1, tied=False)
    cp.load(tmp_path / "c", {"model": fp32})  # strict: the bf16 copies count as used
    for n, p in fp32.named_parameters():
        assert torch.equal(p, masters[n]), n
    bf16 = make(1, tied=False)[0].to(torch.bfloat16)
    cp.load(tmp_path / "c", {"model": bf16})
    assert all(torch.equal(p, low.state_dict()[n]) for n, p in bf16.named_parameters())
    half = make(1, tied=False)[0].to(torch.float16)
    with pytest.raises(cp.LoadMismatchError, match="wants float16, but the checkpoint holds no float16 copy"):
        cp.load(tmp_path / "c", {"model": half})


def test_weights_equal_to_their_masters_cast_are_stored_once_and_others_stored_themselves(tmp_path):
    """A mixed-precision state stores its fp32 masters only, the weights recorded as their cast;
    a weight changed since (one element, one bf16 step) is stored itself and loads as it was."""
    model, _, _ = make(0, tied=False)
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    low = make(0, tied=False)[0].to(torch.bfloat16)
    state = {"model": low, "optim": {n: {"master": m} for n, m in masters.items()}}
    cp.save(tmp_path / "cast", state)
    meta = cp.read_metadata(tmp_path / "cast")
    assert meta.casts == {f"model/{n}": f"optim/{n}/master" for n in masters}
    assert meta.total_bytes == sum(m.numel() * 4 for m in masters.values()) + sum(
        o[0].nbytes for o in meta.objects.values())  # no byte of a weight
    with torch.no_grad():
        low.norm.weight[3] = torch.nextafter(low.norm.weight[3], torch.tensor(9.0, dtype=torch.bfloat16))
    changed = low.state_dict()["norm.weight"].clone()
    cp.save(tmp_path / "edited", state)
    assert cp.read_metadata(tmp_path / "edited").casts == {}
    for path, norm in (("cast", masters["norm.weight"].to(torch.bfloat16)), ("edited", changed)):
        fresh = make(1, tied=False)[0].to(torch.bfloat16)
        cp.load(tmp_path / path, {"model": fresh}, strict=False)
        assert torch.equal(fresh.norm.weight, norm), path
        assert all(torch.equal(p, masters[n].to(torch.bfloat16)) for n, p in fresh.named_parameters() if n != "norm.weight")
    assert bcp(["verify", str(tmp_path / "cast")]) == 0
    assert bcp(["diff", str(tmp_path / "cast"), str(tmp_path / "edited")]) == 1  # one element of norm.weight


def test_an_optimizer_load_replaces_the_live_state_as_torch_does(tmp_path):
    model, opt, sched = make(0)
    cp.save(tmp_path / "before", {"model": model, "optim": opt})  # before the first step: no state
    for step in range(2):
        train_step(model, opt, sched, step)
    cp.save(tmp_path / "trained", {"model": model, "optim": opt})
    trained = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
               for k, s in opt.state_dict()["state"].items()}

    fresh_model, fresh, _ = make(1)
    cp.load(tmp_path / "before", {"model": fresh_model, "optim": fresh})
    assert fresh.state_dict()["state"] == {} and len(fresh.state) == 0  # torch leaves {}, not {0: {}, ...}
    # a strict load of the pre-step checkpoint into the trained optimizer replaces its moments with none
    cp.load(tmp_path / "before", {"model": model, "optim": opt})
    assert opt.state_dict()["state"] == {}
    cp.load(tmp_path / "trained", {"model": fresh_model, "optim": fresh})
    loaded = fresh.state_dict()["state"]
    assert loaded.keys() == trained.keys()
    for k in trained:
        assert loaded[k].keys() == trained[k].keys()
        assert all(torch.equal(loaded[k][n], trained[k][n]) for n in trained[k])

    # a checkpoint that holds no optimizer leaves it alone (strict: named as missing)
    cp.save(tmp_path / "weights", {"model": model})
    with pytest.raises(cp.LoadMismatchError, match="keys missing from the checkpoint: optim/embed_tokens.weight/exp_avg"):
        cp.load(tmp_path / "weights", {"model": fresh_model, "optim": fresh})
    cp.load(tmp_path / "weights", {"model": fresh_model, "optim": fresh}, strict=False)
    assert all(torch.equal(fresh.state_dict()["state"][k][n], trained[k][n]) for k in trained for n in trained[k])


@pytest.mark.parametrize("flags", [{}, {"capturable": True}, {"fused": True}, {"foreach": True}])
@pytest.mark.parametrize("param_dtype, stored", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.int64, torch.float32), (torch.bfloat16, torch.uint8)])
def test_optimizer_state_takes_the_device_and_dtype_torchs_own_load_gives_it(flags, param_dtype, stored):
    """torch keeps a "step" on the CPU as stored unless its group is capturable or fused, and
    gives the rest the parameter's device and floating dtype (here a meta parameter;
    tests/test_cuda.py loads into CUDA parameters); integer state (bitsandbytes' 8-bit moments)
    keeps its dtype, as bitsandbytes' own load keeps it."""
    from ckpt_plugins._src.state import torch_placement
    param, group = torch.empty(3, device="meta", dtype=param_dtype), {"params": [0], **flags}
    for key in ("step", "exp_avg", "exp_avg_sq"):
        value = torch.zeros((), dtype=stored)
        torch_gives = torch.optim.Optimizer._process_value_according_to_param_policy(param, value, 0, [group], key)
        dtype = stored if key != "step" and not stored.is_floating_point else torch_gives.dtype
        assert torch_placement(key, group, param, stored) == (torch_gives.device, dtype), key


def test_fp32_moments_load_into_a_bf16_optimizer_as_its_own_dtype_as_torch_casts_them(tmp_path):
    """A checkpoint of fp32 Adam moments (a mixed-precision framework's) into a plain optimizer of
    bf16 parameters, with no state yet and with some: the moments become bf16, as
    `load_state_dict` casts them, and the optimizer steps (torch's Adam refuses fp32 moments of
    bf16 parameters)."""
    model, opt, sched = make(0)
    for step in range(2):
        train_step(model, opt, sched, step)
    model.to(torch.bfloat16)  # bf16 weights beside fp32 moments, as mixed-precision frameworks keep them
    cp.save(tmp_path / "mixed", {"model": model, "optim": opt})
    expected = {k: {n: v if n == "step" else v.to(torch.bfloat16) for n, v in s.items()}
                for k, s in opt.state_dict()["state"].items()}
    fresh, fresh_opt, fresh_sched = make(1)
    fresh.to(torch.bfloat16)
    for trained in (False, True):
        cp.load(tmp_path / "mixed", {"model": fresh, "optim": fresh_opt})
        loaded = fresh_opt.state_dict()["state"]
        assert loaded.keys() == expected.keys()
        for k in expected:
            for n, v in expected[k].items():
                assert loaded[k][n].dtype == v.dtype and torch.equal(loaded[k][n], v), (trained, k, n)
        train_step(fresh, fresh_opt, fresh_sched, 2)


def test_parameters_the_checkpoints_optimizer_never_had_are_missing_not_reset(tmp_path):
    """A checkpoint whose optimizer left some parameters out (experts not saved, renamed
    parameters) does not silently restart their moments from zero: a strict load names them."""
    model, opt, sched = make(0)
    train_step(model, opt, sched, 0)
    kept = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    without_norm = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith("norm.")])
    model(batch(1)).sum().backward()
    without_norm.step()
    cp.save(tmp_path / "c", {"model": model, "optim": without_norm})
    with pytest.raises(cp.LoadMismatchError, match="keys missing from the checkpoint: optim/norm.bias/exp_avg, "
                                                   "optim/norm.bias/exp_avg_sq, optim/norm.bias/step, optim/norm.weight"):
        cp.load(tmp_path / "c", {"model": model, "optim": opt})
    result = cp.load(tmp_path / "c", {"model": model, "optim": opt}, strict=False)
    assert result.missing_keys == [f"optim/norm.{n}/{s}" for n in ("bias", "weight")
                                   for s in ("exp_avg", "exp_avg_sq", "step")]
    for name, p in model.named_parameters():  # the norm's moments kept, the others' loaded
        live = opt.state[p]
        assert all(torch.equal(live[k], (kept[name] if name.startswith("norm.") else without_norm.state[p])[k])
                   for k in live)


class Growing(nn.Module):
    """Holds a buffer whose length only a load knows: it resizes the buffer in its own
    `_load_from_state_dict`, as quantized and cache modules do."""

    def __init__(self, n=0):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("table", torch.zeros(n))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self.table = torch.empty_like(state_dict[prefix + "table"])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Hooked(nn.Module):
    """A load pre-hook that converts what is loaded (a checkpoint in another unit, say)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self._register_load_state_dict_pre_hook(self._halve)

    @staticmethod
    def _halve(state_dict, prefix, *args):
        state_dict[prefix + "scale"] = state_dict[prefix + "scale"] / 2


class Model(nn.Module):
    def __init__(self, n=0):
        super().__init__()
        self.plain = nn.Linear(3, 3)
        self.growing = Growing(n)
        self.hooked = Hooked()


class Overriding(Model):
    """A model whose own load_state_dict does something (counts here)."""
    loaded = 0

    def load_state_dict(self, state_dict, strict=True, assign=False):
        self.loaded += 1
        return super().load_state_dict(state_dict, strict, assign)


def test_modules_that_load_themselves_get_their_hooks_as_with_torch(tmp_path):
    torch.manual_seed(0)
    saved = Model(12)
    saved.growing.table.copy_(torch.arange(12.0))
    cp.save(tmp_path / "c", {"model": saved})
    for kind in (Model, Overriding):
        torch.manual_seed(1)
        ours, reference = kind(), kind()
        reference.load_state_dict(saved.state_dict())
        plain_before = ours.plain.weight
        cp.load(tmp_path / "c", {"model": ours})
        for k, v in reference.state_dict().items():
            assert torch.equal(ours.state_dict()[k], v), k
        assert ours.growing.table.shape == (12,) and torch.equal(ours.hooked.scale, saved.hooked.scale / 2)
        assert ours.plain.weight is plain_before  # parameters are loaded in place
        if kind is Overriding:
            assert ours.loaded == 1
