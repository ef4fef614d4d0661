"""Out to PyTorch's own format: a checkpoint (ours, or any read in place) written as a DCP
checkpoint whose state dict is `get_state_dict`'s, {"model": {fqn: tensor}, "optim": {"state":
{fqn: {name: tensor}}, "param_groups": [...]}}: `dcp.load` then `set_state_dict` put it into an
FSDP2 model and its optimizer. DCP itself writes the files; each tensor is read from the
checkpoint only when DCP writes it, so memory holds one tensor at a time.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from ..committed import read_object
from ..errors import NotACheckpointError
from ..format import MASTER, MODEL, OPTIM, dtype_from_name
from ..offline import open_checkpoint, read_tensor


def _placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    """What DCP plans a tensor from (size, dtype), holding no memory: the data comes at write time."""
    return torch.empty((), dtype=dtype).expand(tuple(shape))


def export_dcp(path, out: str, *, optimizer: bool = False) -> List[str]:
    """Write the checkpoint at `path` (model, and the optimizer with `optimizer`) as a DCP checkpoint
    in `out`. fp32 masters are not written (a torch optimizer has none). Returns the keys written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    storage, metadata = open_checkpoint(path)
    sources: Dict[str, str] = {}  # DCP's flattened key -> our stored key
    model: Dict[str, Any] = {}
    for key in sorted(set(metadata.tensors) | set(metadata.aliases)):
        if key.startswith(MODEL + "/"):
            stored = metadata.aliases.get(key, key)
            meta = metadata.tensors[stored]
            model[key[len(MODEL) + 1:]] = _placeholder(meta.shape, dtype_from_name(meta.dtype))
            sources[f"model.{key[len(MODEL) + 1:]}"] = stored
    if not model:
        raise NotACheckpointError(f"{path} holds no model weights ('{MODEL}/...' tensors) to export")
    state: Dict[str, Any] = {"model": model}
    if optimizer:
        groups_key = f"{OPTIM}/param_groups"
        if groups_key not in metadata.objects:
            raise NotACheckpointError(f"{path} holds no optimizer state (no {groups_key}); export without it")
        per_param: Dict[str, Dict[str, Any]] = {}
        for key in list(metadata.tensors) + list(metadata.objects):
            if not key.startswith(OPTIM + "/") or key == groups_key:
                continue
            pname, _, sname = key[len(OPTIM) + 1:].rpartition("/")
            if sname == MASTER:
                continue
            if key in metadata.tensors:
                meta = metadata.tensors[key]
                per_param.setdefault(pname, {})[sname] = _placeholder(meta.shape, dtype_from_name(meta.dtype))
                sources[f"optim.state.{pname}.{sname}"] = key
            else:
                per_param.setdefault(pname, {})[sname] = read_object(storage, metadata, key, None)
        state["optim"] = {"state": per_param, "param_groups": read_object(storage, metadata, groups_key, None)}

    class _Reading(DefaultSavePlanner):
        def resolve_data(self, write_item):
            key = sources.get(write_item.index.fqn)
            if key is None:
                return super().resolve_data(write_item)
            return read_tensor(storage, metadata, key)

    dcp.save(state, checkpoint_id=out, planner=_Reading(), no_dist=True)
    return sorted(sources)
