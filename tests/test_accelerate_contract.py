"""accelerate's contract with `hf_ext.accelerate.enable`: `Accelerator.save_state()`/`load_state()`
with automatic checkpoint naming, `total_limit` rotation, a registered custom object and the
save/load pre-hooks behave as stock (folders, counters, losses, learning rates, hooks), and a run
interrupted after a save and resumed with `load_state()` continues the uninterrupted one bit for
bit."""
import os
import shutil
import time

import pytest
import torch

from distributed import run_env_ranks
from hf_models import accelerate_step, tiny_llama


class Counter:
    """An object registered with `register_for_checkpointing`."""

    def __init__(self):
        self.seen = 0

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def run(rank, world, project, plugin, resume, snapshot, result_path):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    import hf_ext.accelerate
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True, total_limit=2))
    model = tiny_llama(0 if not resume else 5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = accelerator.prepare(model, opt, sched)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    hooked = []
    accelerator.register_save_state_pre_hook(lambda models, weights, out: hooked.append(("save", os.path.basename(out))))
    accelerator.register_load_state_pre_hook(lambda models, out: hooked.append(("load", os.path.basename(out))))
    if plugin:
        hf_ext.accelerate.enable(accelerator)
    log, first = {}, 0
    if resume:
        accelerator.load_state()  # the latest checkpoint_<i>
        accelerator.project_configuration.iteration = 2  # as a user resuming with automatic naming does
        first = 4
    for i in range(first, 6):
        loss = accelerate_step(accelerator, model, opt, sched, i)
        counter.seen += 1
        log[i] = (loss, sched.get_last_lr())
        if i % 2 == 1:
            accelerator.save_state()
            if i == 3 and snapshot and rank == 0:
                shutil.copytree(project, snapshot)
    trained = counter.seen
    # an explicit folder is overwritten, as accelerate overwrites it
    accelerator.project_configuration.automatic_checkpoint_naming = False
    folder = os.path.join(project, "explicit")
    for seen in (100, 200):
        counter.seen = seen
        accelerator.save_state(folder)
    counter.seen = 0
    accelerator.wait_for_everyone()  # (stock: only the main process writes)
    accelerator.load_state(folder)
    if rank == 0:
        torch.save({"log": log, "hooked": hooked, "overwritten": counter.seen, "step": accelerator.step, "counter": trained,
                    "iteration": accelerator.save_iteration, "dirs": sorted(os.listdir(f"{project}/checkpoints")),
                    "weights": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
                    "moments": {k: {n: t.clone() for n, t in s.items()} for k, s in opt.optimizer.state_dict()["state"].items()}},
                   result_path)


def test_accelerate_save_state_with_the_plugin_keeps_accelerates_folders_hooks_and_resumes_exactly(tmp_path):
    results = {}
    for name, plugin in (("stock", False), ("ours", True)):
        run_env_ranks(2, run, str(tmp_path / name), plugin, False, str(tmp_path / f"{name}-at-3"), tmp_path / f"{name}.pt")
        results[name] = torch.load(tmp_path / f"{name}.pt")
    ours, stock = results["ours"], results["stock"]
    assert ours["dirs"] == stock["dirs"] == ["checkpoint_1", "checkpoint_2"]  # total_limit rotated checkpoint_0
    assert ours["log"] == stock["log"] and ours["hooked"] == stock["hooked"]
    assert ours["overwritten"] == stock["overwritten"] == 200
    assert (ours["step"], ours["counter"], ours["iteration"]) == (stock["step"], stock["counter"], stock["iteration"])
    assert os.path.exists(tmp_path / "ours" / "checkpoints" / "checkpoint_2" / "metadata.json")
    # interrupted after the save at step 3, resumed with load_state(): the uninterrupted run
    run_env_ranks(2, run, str(tmp_path / "ours-at-3"), True, True, None, tmp_path / "resumed.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    assert resumed["log"] == {i: ours["log"][i] for i in (4, 5)}
    assert resumed["hooked"][:2] == [("load", "checkpoint_1"), ("save", "checkpoint_2")]
    assert resumed["dirs"] == ours["dirs"] and resumed["step"] == ours["step"]
    assert all(torch.equal(resumed["weights"][k], v) for k, v in ours["weights"].items())
    assert all(torch.equal(resumed["moments"][k][n], t) for k, s in ours["moments"].items() for n, t in s.items())


def async_save_then_end_training(rank, world, path):
    from accelerate import Accelerator

    import ckpt_plugins as cp
    import hf_ext.accelerate
    from ckpt_plugins._src.storage.local import LocalStorage
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(tiny_llama(0))
    hf_ext.accelerate.enable(accelerator, async_save=True)
    native = LocalStorage.open_writer
    LocalStorage.open_writer = lambda self, name: (time.sleep(0.3), native(self, name))[1]  # still writing at the end
    accelerator.save_state(path)
    handle = cp.checkpointer()._last
    accelerator.end_training()  # what accelerate asks every script to end with: it destroys the process group
    assert handle.done()


def test_end_training_right_after_an_asynchronous_save_state_leaves_it_committed(tmp_path):
    import ckpt_plugins as cp
    run_env_ranks(2, async_save_then_end_training, str(tmp_path / "ckpt"))
    model = tiny_llama(5)
    cp.load(tmp_path / "ckpt", {"model": model}, strict=False)
    assert all(torch.equal(v, tiny_llama(0).state_dict()[k]) for k, v in model.state_dict().items())


def test_a_save_without_hooks_gathers_no_state_dict(tmp_path, monkeypatch):
    """accelerate hands its save hooks each model's state dict (none under FSDP); without hooks
    nothing asks for one, so an FSDP model is never gathered for a save."""
    from accelerate import Accelerator

    import hf_ext.accelerate
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(tiny_llama(0))
    hf_ext.accelerate.enable(accelerator)
    monkeypatch.setattr(accelerator, "get_state_dict", lambda *a, **k: pytest.fail("state dict gathered"))
    accelerator.save_state(str(tmp_path / "ckpt"))
    assert os.path.exists(tmp_path / "ckpt" / "metadata.json")


def test_a_host_memory_budget_given_to_enable_streams_save_state_through_it_compressed(tmp_path):
    from accelerate import Accelerator

    import ckpt_plugins as cp
    import hf_ext.accelerate
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(tiny_llama(0))
    hf_ext.accelerate.enable(accelerator, host_memory="64KiB", compress=True)
    try:
        accelerator.save_state(str(tmp_path / "ckpt"))
        info = cp.checkpointer()._last.wait()
        assert info.rank_bytes > 64 << 10 >= cp.checkpointer().pool.allocated_bytes > 0  # streamed
        assert any(b.group for t in cp.read_metadata(tmp_path / "ckpt").tensors.values() for b in t.boxes)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        accelerator.load_state(str(tmp_path / "ckpt"))
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
        with pytest.raises(ValueError, match=r"compress must be True, False or 'auto', not 'fast'"):
            hf_ext.accelerate.enable(accelerator, compress="fast")
    finally:
        cp.checkpointer().host_memory = None  # the process's default checkpointer, shared by later tests
        cp.checkpointer().compress = False
