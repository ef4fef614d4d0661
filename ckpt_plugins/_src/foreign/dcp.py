"""PyTorch DCP checkpoints (`dcp.save`, and the frameworks that save through it) as foreign checkpoints.

`.metadata` is a pickle: it is read with an allowlist of DCP's own metadata classes, never by
running code from it. Each stored tensor chunk is a small `torch.save` archive (an uncompressed
zip) at an offset `.metadata` gives; its `data.pkl` is read with an allowlist too, only to learn
where in the archive the chunk's raw bytes lie, so a chunk is one stored box read in place.
Other items (DCP's bytes entries) are `torch.save` payloads, read back weights-only.

Names: DCP flattens nested state dicts with dots. `optim.state.<fqn>.<state>` (also `optimizer.`
or no prefix, as `get_state_dict` flattens it) becomes `optim/<fqn>/<state>`, the param groups one
`optim/param_groups`, and the model's tensors `model/<fqn>`, with a leading `model.` removed when
every model tensor has one and the checkpoint holds other entries beside it (a state dict saved as
{"model": ..., "optim": ...}). A framework's own names (registered `DcpNaming`s, entry point
`ckpt_plugins.dcp_names`) become the HF family names.
"""
from __future__ import annotations

import collections
import json
import math
import re
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..errors import CorruptCheckpointError, NotACheckpointError
from ..format import MODEL, OPTIM, ObjectMeta, StoredBox, check_relative_path
from ..objects import decode_object
from ..storage import Storage
from .archive import TensorLocation, read_archive
from .pickles import load_pickle_restricted
from .view import FOREIGN_CHUNK, ForeignMetadata, RowPermute, computed, raw_box, tensor_meta

NAME = "PyTorch DCP"
DCP_METADATA = ".metadata"
CONFIG = "config.json"  # an HF config beside a checkpoint stored rotary-permuted: its attention head size
_STATE = re.compile(r"(?:(?:optim|optimizer)\.)?state\.(.+)\.([^.]+)")
_GROUPS = re.compile(r"(?:(?:optim|optimizer)\.)?param_groups\.(.+)\.([^.]+)")


def dcp_classes() -> Dict[Tuple[str, str], Any]:
    """What a DCP `.metadata` pickle may name: DCP's metadata dataclasses, torch sizes and dtypes."""
    import pathlib

    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md
    import torch.distributed.checkpoint.planner as pl
    allowed: Dict[Tuple[str, str], Any] = {
        (md.__name__, n): getattr(md, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                   "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                   "StorageMeta", "_MEM_FORMAT_ENCODING")}
    allowed.update({(pl.__name__, n): getattr(pl, n) for n in ("SavePlan", "WriteItem", "WriteItemType",
                                                               "TensorWriteData")})
    allowed[(fs.__name__, "_StorageInfo")] = fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a name -> layout lookup
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    allowed[("pathlib", "PosixPath")] = pathlib.PurePosixPath  # a checkpoint_id: kept as an inert path
    allowed.update({("torch", n): getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)})
    return allowed


def read_dcp_metadata(storage: Storage):
    """DCP's own `Metadata` object from `.metadata`, through the allowlist; every file it names
    checked to lie inside the checkpoint."""
    md = load_pickle_restricted(storage.read_bytes(DCP_METADATA), dcp_classes(), f"{storage}/{DCP_METADATA}")
    if not isinstance(getattr(md, "state_dict_metadata", None), dict) or not isinstance(getattr(md, "storage_data", None), dict):
        raise CorruptCheckpointError(f"{storage}/{DCP_METADATA} is not DCP metadata")
    for info in md.storage_data.values():
        check_relative_path(info.relative_path)
    return md


def chunk_location(storage: Storage, info, fqn: str, dtype: torch.dtype, sizes: Tuple[int, ...]) -> int:
    """The offset in `info.relative_path` of a tensor chunk's raw row-major bytes (see the module
    docstring); a clear error when the item is not a plain tensor of `sizes`."""
    loc = read_archive(storage, info.relative_path, info.offset, info.length)
    if not isinstance(loc, TensorLocation) or loc.shape != tuple(sizes) or loc.dtype != dtype or not loc.contiguous:
        raise CorruptCheckpointError(f"{storage}/{info.relative_path}: {fqn} is stored as {loc!r}; expected a "
                                     f"contiguous {list(sizes)} {dtype} chunk")
    return loc.offset


def _model_prefix(model_keys: List[str], others: bool) -> str:
    """'model.' when the state dict was saved nested under "model" (see the module docstring)."""
    nested = model_keys and all(k.startswith("model.") for k in model_keys)
    return "model." if nested and (others or all(k.startswith("model.model.") for k in model_keys)) else ""


def dcp_index(md) -> Dict[Tuple[str, Optional[Tuple[int, ...]]], Any]:
    """DCP's storage records by (key, chunk offsets; None for a bytes item)."""
    return {(i.fqn, None if i.offset is None else tuple(i.offset)): info for i, info in md.storage_data.items()}


def chunk_boxes(storage: Storage, md, index, fqn: str) -> List[StoredBox]:
    """The stored tensor `fqn`'s chunks as raw boxes of its global shape, read in place."""
    meta = md.state_dict_metadata[fqn]
    dtype, boxes = meta.properties.dtype, []
    for chunk in meta.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        info = index.get((fqn, offsets))
        if info is None:
            raise CorruptCheckpointError(f"{storage}: {DCP_METADATA} has no stored item for {fqn} at {list(offsets)}")
        boxes.append(raw_box(info.relative_path, chunk_location(storage, info, fqn, dtype, sizes), dtype,
                             offsets, sizes))
    return boxes


def data_files(storage: Storage, index) -> Dict[str, int]:
    """The data files DCP's records name, with their sizes; every record checked to fit its file."""
    files: Dict[str, int] = {}
    for info in index.values():
        if getattr(info, "transform_descriptors", None):
            raise NotACheckpointError(f"{storage}: DCP items written through stream transforms "
                                      f"({info.transform_descriptors}) are not read in place; load with dcp.load")
        name = info.relative_path
        if name not in files:
            if not storage.exists(name):
                raise CorruptCheckpointError(f"{storage}: {DCP_METADATA} names {name}, which the directory lacks")
            files[name] = storage.size(name)
        if info.offset + info.length > files[name]:
            raise CorruptCheckpointError(f"{storage}/{name} is truncated: {files[name]} bytes, an item needs "
                                         f"{info.offset + info.length}")
    return files


def read_dcp(storage: Storage) -> ForeignMetadata:
    """The DCP checkpoint at `storage` as foreign metadata (see the module docstring)."""
    md = read_dcp_metadata(storage)
    index = dcp_index(md)
    files = data_files(storage, index)
    entries = md.state_dict_metadata
    tensor_keys = [k for k, v in entries.items() if hasattr(v, "chunks")]
    groups = [k for k in entries if _GROUPS.fullmatch(k)]
    model_keys = [k for k in tensor_keys if not _STATE.fullmatch(k)]
    prefix = _model_prefix(model_keys, len(model_keys) < len(entries))
    names = _Names(storage, [k[len(prefix):] for k in model_keys])
    tensors, transforms = {}, {}
    for fqn in tensor_keys:
        meta = entries[fqn]
        m = _STATE.fullmatch(fqn)
        dtype, boxes = meta.properties.dtype, chunk_boxes(storage, md, index, fqn)
        for name, shape, named_boxes in names.tensors(m.group(1) if m else fqn[len(prefix):], tuple(meta.size),
                                                       dtype, boxes):
            key = f"{OPTIM}/{name}/{m.group(2)}" if m else f"{MODEL}/{name}"
            tensors[key] = tensor_meta(shape, dtype, named_boxes)
            if names.permuted.get(name) and len(shape) == 2:
                transforms[key] = RowPermute(names.permuted[name])
    objects: Dict[str, List[ObjectMeta]] = {}
    for fqn, meta in entries.items():
        if fqn in tensor_keys or fqn in groups:
            continue
        info = index[(fqn, None)]
        objects[fqn] = [ObjectMeta(file=info.relative_path, offset=info.offset, nbytes=info.length, crc32c=[],
                                   encoding="torch")]
    if groups:
        items = {k: index[(k, None)] for k in groups}
        objects[f"{OPTIM}/param_groups"] = computed(lambda: _param_groups(storage, items, names.of))
    return ForeignMetadata(tensors=tensors, objects=objects, files=files, framework="dcp",
                           layout={"format": "dcp", "names": names.kind}, chunk_bytes=FOREIGN_CHUNK, source=NAME,
                           transforms=transforms)


@dataclass(frozen=True)
class DcpNaming:
    """A framework's own tensor names in DCP checkpoints, as the HF family's: `matches(model
    names)`, `rename(name)` (None: no HF name), `stacked(name)` (stacked experts: the HF name with
    `{}` for the expert index, else None), `rotary_permuted(HF names)`: q/k rows stored in Meta's
    rotary order per attention head."""
    name: str
    matches: Callable[[List[str]], bool]
    rename: Callable[[str], Optional[str]]
    stacked: Callable[[str], Optional[str]]
    rotary_permuted: Callable[[List[str]], bool]


_NAMINGS: List[DcpNaming] = []
_FOUND: List[bool] = []


def register_dcp_naming(naming: DcpNaming) -> None:
    if all(n.name != naming.name for n in _NAMINGS):
        _NAMINGS.append(naming)


def _namings() -> List[DcpNaming]:
    if not _FOUND:
        _FOUND.append(True)
        for entry in entry_points(group="ckpt_plugins.dcp_names"):
            register_dcp_naming(entry.load())
    return _NAMINGS


def head_dim(config: Dict) -> int:
    """The attention head size an HF config.json gives."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


class _Names:
    """The names a DCP checkpoint's model tensors load under: as stored, or a framework's mapped to
    the HF family names (a registered `DcpNaming`), its stacked experts split into per-expert
    tensors and q/k rows stored rotary-permuted put back in HF's order, which needs the head size
    from a config.json beside the checkpoint."""

    def __init__(self, storage: Storage, model_names: List[str]):
        self.naming = next((n for n in _namings() if n.matches(model_names)), None)
        self.kind = self.naming.name if self.naming else "as stored"
        self.permuted: Dict[str, int] = {}  # HF name -> head dim, for RowPermute
        self.experts: Dict[str, List[str]] = {}  # a stacked tensor's name -> its experts' names
        if self.naming is None:
            return
        hf = [self.naming.rename(n) for n in model_names]
        if self.naming.rotary_permuted([n for n in hf if n]):
            if not storage.exists(CONFIG):
                raise NotACheckpointError(
                    f"{storage} is a {self.kind} checkpoint whose q/k rows are stored in Meta's rotary order per "
                    f"attention head: put the model's HF {CONFIG} beside {DCP_METADATA} so the head size is known")
            try:
                size = head_dim(json.loads(storage.read_bytes(CONFIG)))
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptCheckpointError(f"{storage}/{CONFIG} gives no attention head size: {exc}") from None
            self.permuted = {n: size for n in hf if n and n.endswith((".q_proj.weight", ".k_proj.weight"))}

    def of(self, name: str) -> List[str]:
        """The names `name` loads as (a stacked expert tensor: one per expert, known from its shape)."""
        if self.naming is None:
            return [name]
        return self.experts.get(name) or [self.naming.rename(name) or name]

    def tensors(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype, boxes: List[StoredBox]):
        """(name, shape, boxes) of the tensors a stored one is: itself renamed, or one per expert."""
        stacked = self.naming.stacked(name) if self.naming else None
        if stacked is None:
            return [(self.of(name)[0], shape, boxes)]
        per_expert: Dict[int, List[StoredBox]] = collections.defaultdict(list)
        for box in boxes:  # each expert of a chunk is contiguous in it
            inner = math.prod(box.lengths[1:]) * dtype.itemsize
            for e in range(box.offsets[0], box.offsets[0] + box.lengths[0]):
                per_expert[e].append(raw_box(box.file, box.offset + (e - box.offsets[0]) * inner, dtype,
                                             box.offsets[1:], box.lengths[1:]))
        self.experts[name] = [stacked.format(e) for e in range(shape[0])]
        return [(stacked.format(e), shape[1:], per_expert[e]) for e in range(shape[0])]


def _param_groups(storage: Storage, items: Dict[str, Any], rename) -> List[dict]:
    """Param groups as `saved_groups` stores them, from DCP's flattened entries: indexed groups
    (`param_groups.<i>.<key>`, names in `params`), or per parameter (`param_groups.<fqn>.<key>`)."""
    from ..state import saved_groups
    by_owner: Dict[str, Dict[str, Any]] = collections.defaultdict(dict)
    for key, info in items.items():
        owner, name = _GROUPS.fullmatch(key).groups()
        data = bytearray(info.length)
        storage.read_into(info.relative_path, info.offset, data)
        by_owner[owner][name] = decode_object(key, "torch", bytes(data))
    if all(o.isdigit() and "params" in g for o, g in by_owner.items()):
        groups = [by_owner[o] for o in sorted(by_owner, key=int)]
    else:
        groups = [{**g, "params": rename(o)} for o, g in sorted(by_owner.items())]
    for g in groups:
        g["params"] = [n for name in g["params"] for n in rename(name)]
    return saved_groups([{k: (v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v) for k, v in g.items()}
                         for g in groups], ())


def is_dcp_dir(storage: Storage) -> bool:
    return storage.exists(DCP_METADATA)

