"""HF model directories in and out: `model.safetensors` (sharded with an index above a size) and
`config.json`, streamed one tensor at a time.

Files are written directly (no pickle, bounded memory, no `transformers` needed) and read by the
core's safetensors reader, the one a load of the directory in place uses.
"""
from __future__ import annotations

import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import ckpt_plugins as cp
from ckpt_plugins import NotACheckpointError
from ckpt_plugins.ext import (BASE, HF_CONFIG, MODEL, SAFE_INDEX, SAFE_NAME, SAFETENSORS_DTYPES, AlignedStream,
                              ForeignMetadata, LazyFragment, Metadata, Storage, TensorSpec, choose_source,
                              dtype_from_name, dtype_name, master_key, open_checkpoint, read_object, read_tensor,
                              reference, resolve, safetensors_metadata, storage_for, write_checkpoint)
from .peft_names import ADAPTER, adapted_weight, config_key, file_name, from_file_name, is_adapter

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


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
            header[name] = {"dtype": SAFETENSORS_DTYPES[d], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
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
                              single=PEFT_WEIGHTS)
    _write_json(os.path.join(out_dir, PEFT_CONFIG), config)
    return files + [PEFT_CONFIG]


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


def import_hf(hf_dir: str, path, *, overwrite: bool = False, adapter: str = "default",
              progress: Optional[Callable[[int], None]] = None):
    """An HF model directory (safetensors, single or sharded; FP8 block-quantized ones
    dequantized into the dtype config.json names) becomes a ckpt_plugins checkpoint whose
    `model/<name>` tensors load under every framework extension. A PEFT adapter directory
    (`adapter_config.json`, `adapter_model.safetensors`) becomes the adapter `adapter`'s tensors
    and config, which load into a PEFT model of any framework. Read by the same reader as a load
    of the directory in place."""
    storage = storage_for(hf_dir)
    objects: Dict[str, Any] = {}
    if storage.exists(PEFT_CONFIG):
        objects[f"{MODEL}/{config_key(adapter)}"] = text = storage.read_bytes(PEFT_CONFIG).decode()
        modules_to_save = json.loads(text).get("modules_to_save") or ()
        if not storage.exists(PEFT_WEIGHTS):
            raise NotACheckpointError(f"{hf_dir} has {PEFT_CONFIG} but no {PEFT_WEIGHTS}")
        metadata = safetensors_metadata(storage, [PEFT_WEIGHTS],
                                        lambda n: f"{MODEL}/{from_file_name(n, adapter, modules_to_save)}")
    else:
        metadata = cp.read_metadata(storage)
        if not isinstance(metadata, ForeignMetadata) or metadata.framework != "hf":
            raise NotACheckpointError(f"{hf_dir} is neither an HF safetensors model directory nor a PEFT adapter")
        if HF_CONFIG in metadata.objects:
            objects[HF_CONFIG] = read_object(storage, metadata, HF_CONFIG, None)
    if metadata.transforms and HF_CONFIG in objects:  # FP8 weights are stored dequantized
        config = json.loads(objects[HF_CONFIG])
        config.pop("quantization_config", None)
        objects[HF_CONFIG] = json.dumps(config, indent=2)
    consumed = {getattr(how, "scale_key", None) for how in metadata.transforms.values()}
    fragments = []
    for key, meta in metadata.tensors.items():
        if key in consumed:
            continue
        how, dtype = metadata.transforms.get(key), dtype_from_name(meta.dtype)
        dtype = how.value_dtype(dtype) if how is not None else dtype
        fragments.append(LazyFragment(key, meta.shape, dtype, (0,) * len(meta.shape), meta.shape,
                                      lambda k=key: read_tensor(storage, metadata, k)))
    return write_checkpoint(path, fragments, objects, aliases=metadata.aliases, framework="hf", overwrite=overwrite,
                            progress=progress)

