"""HF model directories in and out: `model.safetensors` (sharded with an index above a size) and
`config.json`, streamed one tensor at a time.

safetensors layout: an 8-byte little-endian header length, a JSON header ({name: {dtype, shape,
data_offsets}}, offsets relative to the data start), then the raw bytes. Both directions parse
and write it directly: no pickle, bounded memory, and `transformers` is not needed for either.
"""
from __future__ import annotations

import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ckpt_plugins import CheckpointError, CorruptCheckpointError, NotACheckpointError
from ckpt_plugins.ext import (BASE, HF_CONFIG, MODEL, AlignedStream, LazyFragment, Metadata, Storage, TensorSpec,
                              choose_source, dtype_from_name, dtype_name, master_key, open_checkpoint, read_object,
                              read_tensor, reference, resolve, storage_for, write_checkpoint)
from .peft_names import ADAPTER, adapted_weight, config_key, file_name, from_file_name, is_adapter

SAFE_NAME, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}
MAX_HEADER = 100 << 20


# ------------------------------------------------------------------ export


def _layers(path) -> List[Tuple[Storage, Metadata]]:
    """The checkpoint, then the base checkpoint it refers to (an adapter-only save's frozen base):
    a tensor is read from the first that holds it."""
    storage, metadata = open_checkpoint(path)
    layers = [(storage, metadata)]
    if BASE in metadata.objects:
        base = resolve(storage, reference(read_object(storage, metadata, BASE, None)))
        layers.append(open_checkpoint(base))
    return layers


def _holder(layers, key: str):
    return next((st, md) for st, md in layers if key in md.tensors)


def export_hf(path, out_dir: str, *, max_shard_bytes: int = 5 << 30, dtype: Optional[torch.dtype] = None,
              merge_adapter: Optional[str] = None, progress: Optional[Callable[[int], None]] = None,
              rank: int = 0, world: int = 1, config: bool = True) -> List[str]:
    """Write the checkpoint's model weights (`model/...`, a PEFT run's base from the base checkpoint
    it refers to) as HF safetensors into `out_dir`, with its HF `config.json` when it has one (and
    `config`);
    adapters are left out, or merged into the weights they adapt with `merge_adapter` (an adapter's
    name).

    `dtype`: convert on the way (fp32 masters are used where the checkpoint has them and the
    stored weights are of another dtype). `rank` of `world` processes writes every world-th
    shard (rank 0 the index and config as well). Returns the files this rank wrote.
    """
    layers = _layers(path)
    names = sorted({k[len(MODEL) + 1:] for _, md in layers for k in md.tensors
                    if k.startswith(MODEL + "/") and not is_adapter(k[len(MODEL) + 1:])})
    if not names:
        raise NotACheckpointError(f"{path} holds no model weights (no '{MODEL}/...' tensors) to export")
    merge = _merger(layers, merge_adapter) if merge_adapter is not None else {}
    sources = {}
    for name in names:
        storage, metadata = _holder(layers, f"{MODEL}/{name}")
        meta = metadata.tensors[f"{MODEL}/{name}"]
        want = dtype or dtype_from_name(meta.dtype)
        spec = TensorSpec(f"{MODEL}/{name}", tuple(meta.shape), dtype_name(want), (0,) * len(meta.shape),
                          tuple(meta.shape), (master_key(name),), cast=True)
        sources[name] = (storage, metadata, choose_source(metadata, spec), want, tuple(meta.shape))

    def load(name: str, buffer: torch.Tensor) -> torch.Tensor:
        storage, metadata, key, want, _ = sources[name]
        tensor = read_tensor(storage, metadata, key, want, buffer=buffer)
        return merge[name](tensor) if name in merge else tensor

    files = write_safetensors(out_dir, [(n, sources[n][3], sources[n][4]) for n in names], load, max_shard_bytes,
                              progress, rank=rank, world=world)
    storage, metadata = layers[0]
    text = read_object(storage, metadata, HF_CONFIG, None) if config and HF_CONFIG in metadata.objects else None
    if text is not None and rank == 0:  # a plain torch module's checkpoint has none
        _write_json(os.path.join(out_dir, "config.json"), json.loads(text))
        files.append("config.json")
    return files


def write_safetensors(out_dir: str, entries: List[Tuple[str, torch.dtype, Tuple[int, ...]]],
                      load: Callable[[str, torch.Tensor], torch.Tensor], max_shard_bytes: int = 5 << 30,
                      progress: Optional[Callable[[int], None]] = None, single: str = SAFE_NAME,
                      rank: int = 0, world: int = 1) -> List[str]:
    """Tensors (name, dtype, shape; `load(name, buffer)` gives each) as safetensors files in
    `out_dir`, sharded above `max_shard_bytes` with an index, each file renamed into place whole.
    `rank` of `world` writers writes every world-th shard, rank 0 the index too. Returns the files
    this rank wrote."""
    shapes = {n: (d, s) for n, d, s in entries}
    shards = _shard([(n, math.prod(s) * d.itemsize) for n, d, s in entries], max_shard_bytes)
    os.makedirs(out_dir, exist_ok=True)
    out_storage = storage_for(out_dir)
    mine = [i for i in range(len(shards)) if i % world == rank]
    largest = max([math.prod(shapes[n][1]) * shapes[n][0].itemsize for i in mine for n in shards[i]], default=0)
    buffers = [torch.ones(largest, dtype=torch.uint8) for _ in range(2)]  # touched once, reused
    files, weight_map = [], {}
    for index, shard in enumerate(shards):
        fname = single if len(shards) == 1 else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        weight_map.update((name, fname) for name in shard)
        if index not in mine:
            continue
        header, offset = {}, 0
        for name in shard:
            d, shape = shapes[name]
            nbytes = math.prod(shape) * d.itemsize
            header[name] = {"dtype": _ST_DTYPES[d], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        out = AlignedStream(out_storage.open_writer(fname + ".tmp"))
        try:
            out.write(struct.pack("<Q", len(raw)) + raw)
            for tensor in _prefetched(load, shard, buffers):
                data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else b""
                out.write(data)
                if progress:
                    progress(len(data))
                del tensor, data
        finally:
            out.close()
        os.replace(os.path.join(out_dir, fname + ".tmp"), os.path.join(out_dir, fname))
        files.append(fname)
    if len(shards) > 1 and rank == 0:
        total = sum(math.prod(s) * d.itemsize for _, d, s in entries)
        _write_json(os.path.join(out_dir, SAFE_INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map})
        files.append(SAFE_INDEX)
    return files


def _adapter(layers, adapter: str) -> Tuple[Dict[str, Any], Dict[str, str], Any]:
    """An adapter's PEFT config, its stored tensors by stored name, and the layer holding them."""
    for storage, metadata in layers:
        key = f"{MODEL}/{config_key(adapter)}"
        if key in metadata.objects:
            config = json.loads(read_object(storage, metadata, key, None))
            tensors = {k[len(MODEL) + 1:]: k for k in metadata.tensors
                       if k.startswith(f"{MODEL}/{ADAPTER}/{adapter}/")}
            return config, tensors, (storage, metadata)
    known = sorted({k.split("/")[2] for _, md in layers for k in md.objects if k.startswith(f"{MODEL}/{ADAPTER}/")})
    raise NotACheckpointError(f"no adapter {adapter!r} (with its PEFT config) in the checkpoint; it has: "
                              f"{', '.join(known) or 'none'}")


def _merger(layers, adapter: str) -> Dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """For every weight the adapter changes, how to merge it in: W + s·B·A (LoRA; embeddings take
    the transpose), or the trained copy of a `modules_to_save` layer. s = alpha / r (alpha / √r
    with rsLoRA)."""
    config, tensors, (storage, metadata) = _adapter(layers, adapter)
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("fan_in_fan_out"):
        raise ValueError(f"adapter {adapter!r}: only plain LoRA adapters merge here (this one is "
                         f"{config.get('peft_type')}{', DoRA' if config.get('use_dora') else ''}); merge with "
                         "PEFT's merge_and_unload() instead")
    by_weight: Dict[str, Dict[str, str]] = {}
    for stored, key in tensors.items():
        _, weight, kind = adapted_weight(stored)
        by_weight.setdefault(weight, {})[kind] = key
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    read = lambda key: read_tensor(storage, metadata, key).float()  # noqa: E731
    out = {}
    for weight, kinds in by_weight.items():
        if "modules_to_save" in kinds:
            out[weight] = lambda w, k=kinds["modules_to_save"]: read(k).to(w.dtype)
        elif "lora_A" in kinds:
            out[weight] = lambda w, k=kinds: (w.float() + scale * read(k["lora_B"]) @ read(k["lora_A"])).to(w.dtype)
        elif "lora_embedding_A" in kinds:
            out[weight] = lambda w, k=kinds: (w.float() + scale * (read(k["lora_embedding_B"]) @
                                                                  read(k["lora_embedding_A"])).T).to(w.dtype)
    return out


def export_peft(path, out_dir: str, adapter: str = "default") -> List[str]:
    """Write one adapter as PEFT does: `adapter_model.safetensors` and `adapter_config.json`, for
    `PeftModel.from_pretrained(base_model, out_dir)`."""
    layers = _layers(path)
    config, tensors, (storage, metadata) = _adapter(layers, adapter)
    if not tensors:
        raise NotACheckpointError(f"adapter {adapter!r} has no tensors in {path}")
    names = {file_name(stored): key for stored, key in tensors.items()}
    entries = [(n, dtype_from_name(metadata.tensors[k].dtype), tuple(metadata.tensors[k].shape))
               for n, k in sorted(names.items())]
    files = write_safetensors(out_dir, entries, lambda n, buf: read_tensor(storage, metadata, names[n], buffer=buf),
                              single="adapter_model.safetensors")
    _write_json(os.path.join(out_dir, "adapter_config.json"), config)
    return files + ["adapter_config.json"]


def write_model_files(path, out_dir: str, *, rank: int = 0, world: int = 1, config: bool = True,
                      max_shard_bytes: int = 50 * 10**9) -> List[str]:
    """The files `save_pretrained` would write for the checkpoint's model, from the checkpoint: a
    PEFT model's adapters (`adapter_model.safetensors` and `adapter_config.json`, adapters other
    than "default" in a folder of their name), else its weights as HF safetensors (sharded as
    `save_pretrained` shards, 50 GB by default; `config`: with config.json). `rank` of `world`
    writers writes its share. Returns the files this rank wrote."""
    storage, metadata = open_checkpoint(path)
    prefix, suffix = f"{MODEL}/{ADAPTER}/", "/config"
    adapters = sorted(k[len(prefix):-len(suffix)] for k in metadata.objects if k.startswith(prefix) and k.endswith(suffix))
    if not adapters:
        return export_hf(path, out_dir, max_shard_bytes=max_shard_bytes, rank=rank, world=world, config=config)
    files = []
    for i, adapter in enumerate(adapters):
        if i % world == rank:
            where = out_dir if adapter == "default" else os.path.join(out_dir, adapter)
            files += export_peft(path, where, adapter)
    return files


def _prefetched(load, names: List[str], buffers: List[torch.Tensor]):
    """load(name, buffer) for each name, the next one loading (into the other buffer) while the
    caller uses the current: reading overlaps writing, and memory stays at two buffers."""
    with ThreadPoolExecutor(1, thread_name_prefix="export-read") as pool:
        pending = pool.submit(load, names[0], buffers[0]) if names else None
        for i in range(len(names)):
            current = pending.result()
            pending = pool.submit(load, names[i + 1], buffers[(i + 1) % 2]) if i + 1 < len(names) else None
            yield current


def _shard(sizes: List[Tuple[str, int]], limit: int) -> List[List[str]]:
    """Consecutive groups of at most `limit` bytes (a bigger tensor gets a shard of its own)."""
    shards: List[List[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def _write_json(path: str, value) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


# ------------------------------------------------------------------ import


def read_header(path: str) -> Tuple[Dict[str, dict], int]:
    """A safetensors file's tensor entries and the byte offset where its data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CorruptCheckpointError(f"{path} is not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER:
            raise CorruptCheckpointError(f"{path}: safetensors header of {length} bytes is implausible")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise CorruptCheckpointError(f"{path}: safetensors header is not JSON: {exc}") from None
    size = os.path.getsize(path)
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, entry in entries.items():
        start, end = entry.get("data_offsets", (None, None))
        dtype = _FROM_ST.get(entry.get("dtype"))
        if dtype is None or not isinstance(entry.get("shape"), list):
            raise CorruptCheckpointError(f"{path}: tensor {name} has an unsupported dtype or shape {entry}")
        if (type(start), type(end)) != (int, int) or not 0 <= start <= end \
                or end - start != math.prod(entry["shape"]) * dtype.itemsize or 8 + length + end > size:
            raise CorruptCheckpointError(f"{path}: tensor {name}'s byte range {start}..{end} does not fit its "
                                         f"shape or the file")
    return entries, 8 + length


def _read_safetensor(path: str, entry: dict, data_start: int) -> torch.Tensor:
    start, end = entry["data_offsets"]
    dtype = _FROM_ST[entry["dtype"]]
    buf = bytearray(end - start)
    with open(path, "rb") as f:
        f.seek(data_start + start)
        if f.readinto(buf) != len(buf):
            raise CorruptCheckpointError(f"{path} is truncated")
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(entry["shape"]) if buf else \
        torch.empty(entry["shape"], dtype=dtype)


def import_hf(hf_dir: str, path, *, overwrite: bool = False, adapter: str = "default",
              progress: Optional[Callable[[int], None]] = None):
    """An HF model directory (safetensors, single or sharded) becomes a ckpt_plugins checkpoint
    whose `model/<name>` tensors load under every framework extension. A PEFT adapter directory
    (`adapter_config.json`, `adapter_model.safetensors`) becomes the adapter `adapter`'s tensors
    and config, which load into a PEFT model of any framework."""
    index = os.path.join(hf_dir, SAFE_INDEX)
    peft_config = os.path.join(hf_dir, "adapter_config.json")
    objects, aliases = {}, {}
    if os.path.isfile(peft_config):
        with open(peft_config) as f:
            objects[f"{MODEL}/{config_key(adapter)}"] = f.read()
        modules_to_save = json.loads(objects[f"{MODEL}/{config_key(adapter)}"]).get("modules_to_save") or ()
        rename = lambda name: from_file_name(name, adapter, modules_to_save)  # noqa: E731
        files = ["adapter_model.safetensors"]
    elif os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        rename = lambda name: name  # noqa: E731
    elif os.path.isfile(os.path.join(hf_dir, SAFE_NAME)):
        files = [SAFE_NAME]
        rename = lambda name: name  # noqa: E731
    else:
        raise NotACheckpointError(f"{hf_dir} has neither {SAFE_NAME} nor {SAFE_INDEX} nor a PEFT adapter; only "
                                  "safetensors model or adapter directories can be imported")
    fragments = []
    for fname in files:
        if "/" in fname or fname.startswith("."):
            raise CheckpointError(f"{index} names file {fname!r} outside the model directory")
        fpath = os.path.join(hf_dir, fname)
        if not os.path.isfile(fpath):
            raise NotACheckpointError(f"{hf_dir} has no {fname}")
        entries, data_start = read_header(fpath)
        for name, entry in sorted(entries.items()):
            shape = tuple(entry["shape"])
            fragments.append(LazyFragment(f"{MODEL}/{rename(name)}", shape, _FROM_ST[entry["dtype"]],
                                          (0,) * len(shape), shape,
                                          lambda p=fpath, e=entry, s=data_start: _read_safetensor(p, e, s)))
    config_path = os.path.join(hf_dir, "config.json")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            objects[HF_CONFIG] = f.read()
        names = {f.key for f in fragments}
        tied = json.loads(objects[HF_CONFIG]).get("tie_word_embeddings", False)
        if tied and f"{MODEL}/lm_head.weight" not in names and f"{MODEL}/model.embed_tokens.weight" in names:
            aliases[f"{MODEL}/lm_head.weight"] = f"{MODEL}/model.embed_tokens.weight"
    return write_checkpoint(path, fragments, objects, aliases=aliases, framework="hf", overwrite=overwrite,
                            progress=progress)
