"""Does a live job hold exactly what a checkpoint stores? Framework-neutral: the job's own handlers
say which canonical box each of its tensors is."""
from __future__ import annotations

import torch

from ckpt_plugins._src.format import dtype_name
from ckpt_plugins._src.offline import open_checkpoint, read_tensor
from ckpt_plugins._src.format import MASTER, MODEL
from ckpt_plugins._src.state import root_handler


def assert_matches(path, state: dict, weights_only: bool = False, under: tuple = ("",)) -> int:
    """Every weight and optimizer tensor of `state` ("model"/"optim" entries; keys starting with one
    of `under`) equals the checkpoint's canonical tensor, bit for bit; a weight held in another dtype
    than stored is compared with its fp32 master. Returns how many fragments were compared."""
    storage, metadata = open_checkpoint(path)
    items = root_handler({k: v for k, v in state.items() if k in ("model", "optim")}).save_items("")
    cached_key, cached, checked = None, None, 0
    for frag in items.fragments:
        if (weights_only and not frag.key.startswith(f"{MODEL}/")) or not frag.key.startswith(under):
            continue
        key = metadata.aliases.get(frag.key, frag.key)
        if key.startswith(f"{MODEL}/") and (key not in metadata.tensors or
                                            metadata.tensors[key].dtype != dtype_name(frag.local.dtype)):
            key = f"optim/{key[len(MODEL) + 1:]}/{MASTER}"
        assert key in metadata.tensors, f"{frag.key} is not in {path}"
        if key != cached_key:  # one whole tensor in memory at a time
            cached_key, cached = key, read_tensor(storage, metadata, key)
        want = cached
        for d, (o, n) in enumerate(zip(frag.offsets, frag.local.shape)):
            want = want.narrow(d, o, n)
        assert frag.local.dtype == want.dtype and torch.equal(frag.local, want), (path, frag.key, frag.offsets)
        checked += 1
    assert checked > 0
    return checked
