"""Fuzzing the metadata parser and the loader (hypothesis): random bytes, random JSON, mutated valid
metadata (format version 1 and today's, and single elements of the columns version 2 introduced),
mutated data files, forged extents and corrupt chunks of compressed ones. Only the project's own exceptions come out, and the loader never opens a file
outside the checkpoint. Plus planted attacks: pickles that would run code, paths that leave."""
import base64
import dataclasses
import importlib.util
import io
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import ckpt_plugins as cp
from ckpt_plugins._src.format_v2 import BOX_COLUMNS, PACKED_COLUMNS, TENSOR_COLUMNS, WIDTHS
from ckpt_plugins._src.metadata_codec import decode_metadata

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=20)


def column_type(raw: dict, table: str, name: str) -> str:
    """A column's element type as a version-5 body declares it (numpy's name for it)."""
    return WIDTHS[raw["column_types"][table][name]]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_are_metadata_errors(data):
    try:
        decode_metadata(data)
    except cp.MetadataError:
        pass


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_random_json_is_a_metadata_error(value):
    with pytest.raises(cp.MetadataError):
        decode_metadata(json.dumps(value).encode())


FILE_NAMES = st.sampled_from(["data/r0-0.bin", "data/g2-r17-3.bin", "data/r5-objects.bin", "data/../../x.bin",
                               "../outside.bin", "/etc/passwd", "data//r0-0.bin", "data/r0-0.bin\ndata/r1-0.bin",
                               "data/r1-0.bin\n", "data\\r0-0.bin", "", "data/r0-0.bin\x00"]) | st.text(max_size=16)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(FILE_NAMES, st.sampled_from([0, 1, 2**40, -1, True, 2.0, None])), max_size=6))
@example([("data/r0-0.bin", 0), ("data/../../x.bin", 1)])
@example([("data/r0-0.bin", 0), ("data/r1-0.bin", -1)])
@example([("data/r0-0.bin", True)])
@example([("data/r0-0.bin", 0), ("data/r0-0.bin", 1)])
def test_a_file_table_is_checked_at_once_as_it_is_name_by_name(entries):
    """The file table's check of all its names as one string accepts and refuses what the check
    of each name and size does (`check_relative_path`, `require_int`), with its errors."""
    from ckpt_plugins._src.format import check_relative_path, checked_files, need, require_int

    def each(pairs):
        files = {check_relative_path(n): require_int(s, f"files.{n}") for n, s in pairs}
        need(len(files) == len(pairs), "files names a file twice")
        return files

    outcomes = []
    for check in (checked_files, each):
        try:
            outcomes.append(check([list(e) for e in entries]))
        except cp.CheckpointError as exc:
            outcomes.append((type(exc), str(exc)))
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("target", [["model/0.weight"], {"k": 1}, 3, None])
def test_an_alias_to_anything_but_a_stored_key_is_a_metadata_error(valid, target):
    raw = json.loads((valid / "metadata.json").read_text())
    raw["aliases"] = {"model/tied.weight": target}
    with pytest.raises(cp.MetadataError, match="alias model/tied.weight"):
        decode_metadata(json.dumps(raw).encode())


@pytest.mark.parametrize("casts", [{"model/0.weight": "model/1.weight"}, {"model/0.weight": "optim/x/master"},
                                   {"model/x": "model/0.weight"}, {"model/0.weight": 3}, ["model/0.weight"]])
def test_a_cast_that_is_no_fp32_masters_cast_is_a_metadata_error(valid, casts):
    """A weight recorded as its master's cast must be an entry without boxes, its source a stored
    fp32 tensor of its shape: anything else is refused before a byte is read."""
    raw = json.loads((valid / "metadata.json").read_text())
    raw["casts"] = casts
    with pytest.raises(cp.MetadataError, match="cast"):
        decode_metadata(json.dumps(raw).encode())


def state(seed=0):
    torch.manual_seed(seed)
    return {"model": nn.Sequential(nn.Linear(6, 40), nn.Linear(40, 3)), "extra": {"step": 3, "t": torch.arange(5)}}


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    path = tmp_path_factory.mktemp("valid") / "ckpt"
    cp.save(path, state(0))
    return path


@pytest.fixture(scope="module")
def valid_v1(valid, tmp_path_factory):
    """The same checkpoint with its metadata as format version 1 wrote it (no release writes it any more)."""
    path = tmp_path_factory.mktemp("valid_v1") / "ckpt"
    shutil.copytree(valid, path)
    meta = decode_metadata((valid / "metadata.json").read_bytes())
    body = dataclasses.asdict(dataclasses.replace(meta, tensors=dict(meta.tensors), version=1))
    (path / "metadata.json").write_text(json.dumps({"format": "ckpt_plugins", "version": 1, **body}))
    return path


# the interpreter's, the package's and its extensions' own files (a reader's entry point imports its extension)
TRUSTED = tuple(os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(cp.__file__)) + tuple(
    os.path.dirname(importlib.util.find_spec(ext).origin) for ext in ("hf_ext", "deepspeed_ext", "megatron_ext")))


class FileAudit:
    """Records every file this process opens while active (an audit hook cannot be removed, so it
    stays installed and is switched on and off)."""
    active, inside, escapes = False, "", []

    @classmethod
    def install(cls):
        if not getattr(sys, "_ckpt_fuzz_audit", False):
            sys.addaudithook(cls.hook)
            sys._ckpt_fuzz_audit = True

    @classmethod
    def hook(cls, event, args):
        if cls.active and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(args[0]))
            # Formatting a failing rank's traceback reads the package's own sources: not an escape.
            if not path.startswith((cls.inside, "/proc", "/dev") + TRUSTED):
                cls.escapes.append(path)


def mutate(value, path, replacement):
    """`value` with the element at `path` (a list of keys/indices) replaced."""
    if not path:
        return replacement
    head, *rest = path
    if isinstance(value, dict):
        return {k: (mutate(v, rest, replacement) if k == head else v) for k, v in value.items()}
    return [mutate(v, rest, replacement) if i == head else v for i, v in enumerate(value)]


def paths(value, prefix=()):
    yield list(prefix)
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, prefix + (i,))


def load_outcome(path):
    """Load into a fresh state: returns "ok" (then the values must be the saved ones) or the error."""
    target = state(1)
    FileAudit.inside, FileAudit.active = os.path.realpath(path), True
    try:
        cp.load(path, target)
    except cp.CheckpointError as exc:
        return type(exc).__name__
    finally:
        FileAudit.active = False
    ref = state(0)
    for a, b in zip(ref["model"].state_dict().values(), target["model"].state_dict().values()):
        assert torch.equal(a, b)
    return "ok"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.parametrize("version", [1, 2])
def test_mutated_metadata_loads_right_or_fails_with_our_errors_inside_the_checkpoint(valid, valid_v1, version,
                                                                                       tmp_path, data):
    FileAudit.install()
    work = tmp_path / "m"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(valid_v1 if version == 1 else valid, work)
    raw = json.loads((work / "metadata.json").read_text())
    where = data.draw(st.sampled_from(list(paths(raw))))
    replacement = data.draw(JSON | st.sampled_from(["../../etc/passwd", "/etc/passwd", "data/../../x", -1, 2**40,
                                                     "torch", "json", "float64", [0, 0], "model/0.weight"]))
    (work / "metadata.json").write_text(json.dumps(mutate(raw, where, replacement)))
    FileAudit.escapes = []
    load_outcome(work)
    assert FileAudit.escapes == [], FileAudit.escapes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_column_element_loads_right_or_fails_with_our_errors(valid, tmp_path, data):
    """One element of a column set to a hostile value, dropped or added, or the column's declared
    type changed: the columns are checked as wholes, so a value no single-field check would see
    must still be refused."""
    FileAudit.install()
    work = tmp_path / "c"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(valid, work)
    raw = json.loads((work / "metadata.json").read_text())
    table, names = data.draw(st.sampled_from([("tensors", TENSOR_COLUMNS), ("boxes", BOX_COLUMNS)]))
    name = data.draw(st.sampled_from(sorted(names)))
    if data.draw(st.booleans()):  # its bytes read as another type
        raw["column_types"][table][name] = data.draw(st.sampled_from(sorted(WIDTHS) + ["int8", "float32", 8, None]))
    else:
        dtype = column_type(raw, table, name)
        info = np.iinfo(dtype)
        column = np.frombuffer(base64.b64decode(raw[table][name]), dtype=dtype).copy()
        value = data.draw(st.sampled_from([info.min, info.max, 0, 1, -1 % (info.max + 1) if info.min == 0 else -1])
                          | st.integers(int(info.min), int(info.max)))
        kind = data.draw(st.sampled_from(["set", "drop", "add"]))
        if kind == "set" and len(column):
            column[data.draw(st.integers(0, len(column) - 1))] = value
        elif kind == "drop":
            column = column[:-1]
        else:
            column = np.append(column, np.array([value], dtype=dtype))
        raw[table][name] = base64.b64encode(column.astype(dtype).tobytes()).decode()
    (work / "metadata.json").write_text(json.dumps(raw))
    try:  # decoding refuses it, or every entry it accepted can be built
        list(decode_metadata((work / "metadata.json").read_bytes()).tensors.values())
    except cp.MetadataError:
        pass
    FileAudit.escapes = []
    load_outcome(work)
    assert FileAudit.escapes == [], FileAudit.escapes


@pytest.mark.parametrize("table,name,declared", [("boxes", "offset", "float32"), ("boxes", "crc32c", "uint16"),
                                                   ("tensors", "shape", None), ("boxes", "lengths", "uint64")])
def test_a_column_type_outside_the_format_is_a_metadata_error(valid, table, name, declared):
    raw = json.loads((valid / "metadata.json").read_text())
    raw["column_types"][table][name] = declared
    with pytest.raises(cp.MetadataError, match=f"column_types.{table}.{name} must be"):
        decode_metadata(json.dumps(raw).encode())
    del raw["column_types"]
    with pytest.raises(cp.MetadataError, match="column_types must be an object"):
        decode_metadata(json.dumps(raw).encode())


@pytest.mark.parametrize("table,name,values", [
    ("tensors", "boxes", "wrap"),  # counts whose sum wraps around to exactly the boxes there are
    ("tensors", "boxes", [2**62, 2**62]),
    ("boxes", "nbytes", [2**62] * 8),  # a box of more chunks than the checksum column holds
    ("tensors", "shape", [2**40] * 16),  # a tensor of more elements than any float product holds exactly
    ("boxes", "offset", [0] * 64),  # boxes at one place of a file: the read-once exchange keys reads by it
])
def test_column_values_that_would_overflow_are_metadata_errors(valid, table, name, values):
    raw = json.loads((valid / "metadata.json").read_text())
    width = len(np.frombuffer(base64.b64decode(raw[table][name]), dtype=column_type(raw, table, name)))
    if values == "wrap":
        boxes = len(np.frombuffer(base64.b64decode(raw["boxes"]["file"]), dtype=column_type(raw, "boxes", "file")))
        values = [2**63 - 1, 2**63 - 1, boxes + 2] + [0] * (width - 3)  # 2**64 + boxes
    raw[table][name] = base64.b64encode(np.array(values[:width], dtype="<i8").tobytes()).decode()
    raw["column_types"][table][name] = "int64"
    with pytest.raises(cp.MetadataError):
        decode_metadata(json.dumps(raw).encode())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_data_files_load_right_or_fail_as_corrupt(valid, tmp_path, data):
    work = tmp_path / "d"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(valid, work)
    files = sorted(p for p in (work / "data").iterdir())
    target = data.draw(st.sampled_from(files))
    blob = bytearray(target.read_bytes())
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if kind == "flip" and blob:
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        blob = blob[:data.draw(st.integers(0, max(0, len(blob) - 1)))]
    else:
        blob += b"\0" * data.draw(st.integers(1, 100))
    target.write_bytes(bytes(blob))
    assert load_outcome(work) in ("ok", "CorruptCheckpointError")


def compressible(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"ints": torch.arange(300_000, dtype=torch.int32) * seed,  # two chunks
            "w": (torch.randn(300, 500, generator=g) * 0.02).to(torch.bfloat16)}


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    """A delta (its ints) and compressed (its bf16, which changed too much) checkpoint, beside its base."""
    path = tmp_path_factory.mktemp("compressed") / "ckpt"
    base = compressible(1)
    cp.save(path.parent / "base", base, compress=True)
    base["ints"][:1000] += 1
    cp.save(path, {**base, "w": compressible(2)["w"]}, delta_from=path.parent / "base")
    boxes = {k: t.boxes[0] for k, t in cp.read_metadata(path).tensors.items()}
    assert boxes["ints"].delta and boxes["ints"].packed[1] == 0 and boxes["w"].group and boxes["w"].delta
    return path


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_forged_extents_and_corrupt_compressed_chunks_load_right_or_fail_with_our_errors(compressed, tmp_path, data):
    """A compressed or delta box's grouping, delta flag or one chunk's stored length forged, or a
    byte of its frames changed, dropped or added: decoding refuses it, or the load is right or
    `CorruptCheckpointError`."""
    work = tmp_path / "z"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(compressed, work)
    shutil.copytree(compressed.parent / "base", tmp_path / "base", dirs_exist_ok=True)
    if data.draw(st.booleans()):
        raw = json.loads((work / "metadata.json").read_text())
        name = data.draw(st.sampled_from(sorted(PACKED_COLUMNS)))
        dtype = column_type(raw, "boxes", name)
        column = np.frombuffer(base64.b64decode(raw["boxes"][name]), dtype=dtype).copy()
        value = data.draw(st.integers(int(np.iinfo(dtype).min), int(np.iinfo(dtype).max)) | st.sampled_from([0, 1, 3]))
        kind = data.draw(st.sampled_from(["set", "drop", "add"]))
        if kind == "set":
            column[data.draw(st.integers(0, len(column) - 1))] = value
        else:
            column = column[:-1] if kind == "drop" else np.append(column, np.array([value], dtype=dtype))
        raw["boxes"][name] = base64.b64encode(column.tobytes()).decode()
        (work / "metadata.json").write_text(json.dumps(raw))
    else:
        target = work / sorted(cp.read_metadata(work).files)[0]
        blob = bytearray(target.read_bytes())
        i = data.draw(st.integers(0, len(blob) - 1))
        kind = data.draw(st.sampled_from(["flip", "drop", "add"]))
        if kind == "flip":
            blob[i] ^= data.draw(st.integers(1, 255))
        else:
            blob[i:i] = b"\x00" if kind == "add" else b""
            del blob[i:i + (kind == "drop")]
        target.write_bytes(bytes(blob))
    got = {k: torch.zeros_like(v) for k, v in compressible().items()}
    try:
        cp.load(work, got)
    except (cp.MetadataError, cp.CorruptCheckpointError):
        return
    want = {**compressible(1), "w": compressible(2)["w"]}
    want["ints"][:1000] += 1
    for key, value in want.items():
        assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key


def test_a_pickle_that_would_run_code_is_refused_and_never_runs(valid, tmp_path):
    """An object entry whose torch bytes carry a pickle calling os.system: weights_only refuses it."""
    work = tmp_path / "attack"
    shutil.copytree(valid, work)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    payload = buf.getvalue()
    raw = json.loads((work / "metadata.json").read_text())
    entry = raw["objects"]["extra/step"][0]
    data_file = work / entry["file"]
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(payload)
    from ckpt_plugins._src.format import chunk_checksums
    entry.update(offset=offset, nbytes=len(payload), encoding="torch",
                 crc32c=chunk_checksums(payload, raw["chunk_bytes"]) if "chunk_bytes" in raw else chunk_checksums(payload))
    next(f for f in raw["files"] if f[0] == entry["file"])[1] = offset + len(payload)  # [path, size] pairs
    (work / "metadata.json").write_text(json.dumps(raw))
    with pytest.raises(cp.CorruptCheckpointError, match="extra/step"):
        cp.load(work, state(1))
    assert not marker.exists()
    raw["objects"]["extra/step"][0]["encoding"] = "pickle"  # an encoding we never read
    (work / "metadata.json").write_text(json.dumps(raw))
    with pytest.raises(cp.MetadataError):
        cp.load(work, state(1))


# ---------------------------------------------------------------- checkpoints read in place


def foreign_outcome(path, target) -> str:
    """Load a foreign checkpoint into `target`: "ok" or the name of our error; every file opened
    lies inside it. (Foreign formats carry no checksums: a mutation that keeps the files
    self-consistent loads whatever the bytes now say.)"""
    FileAudit.install()
    FileAudit.inside, FileAudit.active, FileAudit.escapes = os.path.realpath(path), True, []
    try:
        cp.load(path, target)
        return "ok"
    except cp.CheckpointError as exc:
        return type(exc).__name__
    finally:
        FileAudit.active = False
        assert FileAudit.escapes == [], FileAudit.escapes


@pytest.fixture(scope="module")
def foreign_dirs(tmp_path_factory):
    """An HF safetensors directory and a DCP checkpoint of the same small model."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    root = tmp_path_factory.mktemp("foreign")
    model = state(0)["model"]
    os.makedirs(root / "hf")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, root / "hf" / "model.safetensors")
    dcp.save({"model": model.state_dict(), "extra": {"step": 3}}, checkpoint_id=root / "dcp", no_dist=True)
    return root


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_safetensors_headers_load_or_fail_with_our_errors_inside_the_directory(foreign_dirs, tmp_path, data):
    import struct
    work = tmp_path / "hf"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(foreign_dirs / "hf", work)
    blob = (work / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    where = data.draw(st.sampled_from(list(paths(header))))
    replacement = data.draw(JSON | st.sampled_from(["F64", "BF16", "F8_E4M3", [0, 2**62], [-1, 4], [0, 0], [2, 3]]))
    raw = json.dumps(mutate(header, where, replacement)).encode()
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw)))]  # a torn header
    (work / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])
    foreign_outcome(work, {"model": state(1)["model"]})


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_dcp_files_load_or_fail_with_our_errors_inside_the_directory(foreign_dirs, tmp_path, data):
    """Flipped, truncated or extended bytes in `.metadata` (a pickle read through an allowlist) or
    in a data file (torch.save archives whose data.pkl is read through one too)."""
    work = tmp_path / "dcp"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(foreign_dirs / "dcp", work)
    target = data.draw(st.sampled_from(sorted(work.iterdir())))
    blob = bytearray(target.read_bytes())
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if kind == "flip" and blob:
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(blob) - 1))
            blob[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        blob = blob[:data.draw(st.integers(0, max(0, len(blob) - 1)))]
    else:
        blob += bytes(data.draw(st.integers(1, 100)))
    target.write_bytes(bytes(blob))
    foreign_outcome(work, {"model": state(1)["model"], "extra": cp.Ignore()})
