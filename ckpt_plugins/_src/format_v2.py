"""Format version 2: the tensor and box tables as columns (version 5: each in its narrowest width).

A checkpoint of a large job has hundreds of thousands of boxes and millions of chunk checksums.
Version 1 spelled each box as a JSON object, so decoding one cost seconds per rank. Version 2
keeps the JSON envelope (format, step, files, objects, aliases stay as they were) and stores each
field of the tensor and box tables as one array of little-endian integers, base64-encoded:
decoding is a base64 decode, array checks over whole columns, and the tensor entries a load asks
for, built when it asks (`TensorTable`).
"""
from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Dict, Iterator, List, Tuple

import numpy as np

from .errors import MetadataError
from .format import StoredBox, TensorMeta, checked_files, dtype_from_name, need

# column -> element type up to version 4; the tensor table has one row per tensor, the box table
# one per box
TENSOR_COLUMNS = {"dtype": "<u1", "ndim": "<u1", "shape": "<i8", "boxes": "<i8"}
BOX_COLUMNS = {"file": "<u4", "offset": "<i8", "nbytes": "<i8", "offsets": "<i8", "lengths": "<i8",
               "crc32c": "<u4"}
# version 4's compressed boxes: each box's grouping (0: stored plainly), whether it is a delta, each
# of a compressed box's chunks' stored bytes
PACKED_COLUMNS = {"group": "<u1", "delta": "<u1", "packed": "<u4"}
# From version 5 on, each column but `crc32c` is stored in the narrowest of these that holds its
# values, named in `column_types`: most values of a large job's tables fit in 32 bits or fewer.
WIDTHS = {"uint8": "<u1", "uint16": "<u2", "uint32": "<u4", "int64": "<i8"}
GROUPS = (1, 2, 4, 8, 16)
_MAX_ELEMENTS = 1 << 53  # a tensor's elements: float64 products of its dims stay exact below this


def encode_tables(tensors: Dict[str, TensorMeta], files: Dict[str, int]) -> dict:
    """The `files`, `dtypes`, `keys`, `tensors` and `boxes` fields of a version-2 metadata body."""
    file_index = {name: i for i, name in enumerate(files)}
    dtypes: Dict[str, int] = {}
    t: Dict[str, list] = {c: [] for c in TENSOR_COLUMNS}
    b: Dict[str, list] = {c: [] for c in {**BOX_COLUMNS, **PACKED_COLUMNS}}
    for meta in tensors.values():
        t["dtype"].append(dtypes.setdefault(meta.dtype, len(dtypes)))
        t["ndim"].append(len(meta.shape))
        t["shape"].extend(meta.shape)
        t["boxes"].append(len(meta.boxes))
        for box in meta.boxes:
            b["file"].append(file_index[box.file])
            b["offset"].append(box.offset)
            b["nbytes"].append(box.nbytes)
            b["offsets"].extend(box.offsets)
            b["lengths"].extend(box.lengths)
            b["crc32c"].extend(box.crc32c)
            b["group"].append(box.group)
            b["delta"].append(int(box.delta))
            b["packed"].extend(box.packed)
    types = {"tensors": {}, "boxes": {}}
    return {"files": [[name, size] for name, size in files.items()], "dtypes": list(dtypes),
            "keys": list(tensors), "column_types": types, "tensors": _encoded(t, types["tensors"]),
            "boxes": _encoded(b, types["boxes"])}


def _encoded(values: Dict[str, list], types: Dict[str, str]) -> Dict[str, str]:
    """Each column as base64, in the narrowest width that holds it (its name put in `types`)."""
    out = {}
    for c, column in values.items():
        if c == "crc32c":  # always uint32 (`Checksums`), and most of the values: converted once
            types[c], array = "uint32", np.asarray(column, dtype=WIDTHS["uint32"])
        else:
            array = np.asarray(column, dtype=np.int64)
            types[c] = _narrowest(array)
            array = array.astype(WIDTHS[types[c]], copy=False)
        out[c] = base64.b64encode(array.tobytes()).decode()
    return out


def _narrowest(array: np.ndarray) -> str:
    if array.size and int(array.min()) < 0:
        return "int64"
    top = int(array.max()) if array.size else 0
    return next(name for name, t in WIDTHS.items() if top <= np.iinfo(t).max)


def decode_tables(raw: dict, chunk_bytes: int, version: int) -> Tuple["TensorTable", Dict[str, int]]:
    """The tensor table and the file table of a version-2 (or later) body, every field checked."""
    files = checked_files(raw.get("files"))
    dtypes = raw.get("dtypes")
    need(isinstance(dtypes, list), "dtypes must be a list")
    itemsizes = np.array([dtype_from_name(d).itemsize for d in dtypes] + [0], dtype=np.int64)
    keys = raw.get("keys")
    need(isinstance(keys, list) and set(map(type, keys)) <= {str}, "keys must be a list of strings")
    if version >= 5:
        tensor_types, box_types = _column_types(raw.get("column_types"))
    else:
        tensor_types, box_types = TENSOR_COLUMNS, {**BOX_COLUMNS, **(PACKED_COLUMNS if version >= 4 else {})}
    t = _decoded(raw.get("tensors"), tensor_types, "tensors")
    b = _decoded(raw.get("boxes"), box_types, "boxes")
    if version < 4:  # every box stored plainly
        b["group"], b["packed"] = np.zeros(len(b["file"]), dtype=np.int64), np.zeros(0, dtype=np.int64)
        b["delta"] = b["group"]
    rows = _Rows(t, b, len(keys), len(dtypes), chunk_bytes)
    _check_boxes(rows, b, itemsizes, np.array(list(files.values()) + [0], dtype=np.int64), len(files))
    return TensorTable(keys, dtypes, list(files), rows), files


def _column_types(raw) -> Tuple[Dict[str, str], Dict[str, str]]:
    """Version 5's `column_types`: each column's element type, one of `WIDTHS` (`crc32c`: uint32)."""
    need(isinstance(raw, dict), "column_types must be an object")
    out = []
    for table, columns in (("tensors", TENSOR_COLUMNS), ("boxes", {**BOX_COLUMNS, **PACKED_COLUMNS})):
        types = raw.get(table)
        need(isinstance(types, dict), f"column_types.{table} must be an object")
        for name in columns:
            need(types.get(name) in WIDTHS, f"column_types.{table}.{name} must be one of {', '.join(WIDTHS)}")
        if table == "boxes":  # decoded a range at a time (`Checksums`)
            need(types["crc32c"] == "uint32", "column_types.boxes.crc32c must be uint32")
        out.append({name: WIDTHS[types[name]] for name in columns})
    return out[0], out[1]


def _decoded(raw, types: Dict[str, str], what: str) -> Dict[str, np.ndarray]:
    """The columns as int64 arrays; `crc32c`, most of the bytes, stays text (`Checksums`)."""
    need(isinstance(raw, dict), f"{what} must be an object of columns")
    columns = {}
    for name, dtype in types.items():
        text = raw.get(name)
        need(isinstance(text, str), f"{what}.{name} must be a base64 string")
        if name == "crc32c":
            columns[name] = Checksums(text, f"{what}.{name}")
            continue
        data = _b64(text, f"{what}.{name}")
        need(len(data) % np.dtype(dtype).itemsize == 0, f"{what}.{name} is not a whole number of elements")
        columns[name] = np.frombuffer(data, dtype=dtype).astype(np.int64)
    return columns


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MetadataError(f"malformed metadata: {what} is not valid base64") from None


class Checksums:
    """The crc32c column, decoded a range at a time: base64 decodes in independent groups of 4
    characters (3 bytes), so a load decodes only the checksums of the tensors it uses."""

    def __init__(self, text: str, what: str):
        padding = len(text) - len(text.rstrip("="))
        need(len(text) % 4 == 0 and padding <= 2, f"{what} is not valid base64")
        nbytes = len(text) // 4 * 3 - padding
        need(nbytes % 4 == 0, f"{what} is not a whole number of elements")
        self.text, self.what, self.count = text, what, nbytes // 4

    def __len__(self) -> int:
        return self.count

    def values(self, start: int, end: int) -> List[int]:
        """Checksums [start, end)."""
        first, last = 4 * start // 3, -(-4 * end // 3)  # the 3-byte groups holding those bytes
        data = _b64(self.text[4 * first:4 * last], self.what)
        skip = 4 * start - 3 * first
        return np.frombuffer(data[skip:skip + 4 * (end - start)], dtype="<u4").tolist()


class _Rows:
    """Where each tensor's and each box's pieces start in the columns (prefix sums), checked to
    add up to the columns' lengths."""

    def __init__(self, t: Dict[str, np.ndarray], b: Dict[str, np.ndarray], ntensors: int, ndtypes: int,
                 chunk_bytes: int):
        self.t, self.b = t, b
        for name in TENSOR_COLUMNS:
            if name != "shape":
                need(len(t[name]) == ntensors, f"tensors.{name} needs one entry per key")
        need(bool((t["dtype"] < ndtypes).all()), "tensors.dtype names a dtype the dtypes list lacks")
        # every count is bounded by the column it counts into, so no prefix sum can overflow
        need(bool((t["ndim"] <= 64).all()) and bool(((t["boxes"] >= 0) & (t["boxes"] <= len(b["file"]))).all()),
             "tensors.ndim or tensors.boxes out of range")
        self.shape_start = _starts(t["ndim"])
        need(len(t["shape"]) == self.shape_start[-1], "tensors.shape needs ndim entries per tensor")
        need(bool((t["shape"] >= 0).all()), "tensors.shape must be >= 0")
        self.box_start = _starts(t["boxes"])
        nboxes = int(self.box_start[-1])
        for name in ("file", "offset", "nbytes"):
            need(len(b[name]) == nboxes, f"boxes.{name} needs one entry per box")
        self.tensor_of_box = np.repeat(np.arange(ntensors), t["boxes"])
        self.box_ndim = t["ndim"][self.tensor_of_box]
        self.dim_start = _starts(self.box_ndim)
        for name in ("offsets", "lengths"):
            need(len(b[name]) == self.dim_start[-1], f"boxes.{name} needs one entry per box and dimension")
        need(bool((b["nbytes"] >= 0).all()), "boxes.nbytes must be >= 0")
        chunks = np.maximum(1, -(-b["nbytes"] // chunk_bytes))
        need(bool((chunks <= len(b["crc32c"])).all()), "boxes.crc32c must hold one checksum per chunk of each box")
        self.crc_start = _starts(chunks)
        need(len(b["crc32c"]) == self.crc_start[-1], "boxes.crc32c must hold one checksum per chunk of each box")
        need(len(b["group"]) == nboxes and len(b["delta"]) == nboxes, "boxes.group and boxes.delta need one entry per box")
        need(bool(np.isin(b["group"], (0,) + GROUPS).all()), f"boxes.group must be 0 or one of {GROUPS}")
        need(bool(((b["delta"] == 0) | ((b["delta"] == 1) & (b["group"] > 0))).all()),
             "boxes.delta must be 0, or 1 for a compressed box")
        self.packed_start = _starts(np.where(b["group"] > 0, chunks, 0))
        need(len(b["packed"]) == self.packed_start[-1],
             "boxes.packed must hold one length per chunk of each compressed box")
        self.chunk_bytes = chunk_bytes


def _starts(counts: np.ndarray) -> np.ndarray:
    """Prefix sums with a leading 0: piece i spans [starts[i], starts[i + 1])."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _products(values: np.ndarray, starts: np.ndarray, dtype) -> np.ndarray:
    """The product of each piece of `values` (1 for an empty piece)."""
    out = np.ones(len(starts) - 1, dtype=dtype)
    filled = starts[1:] > starts[:-1]
    if filled.any():
        out[filled] = np.multiply.reduceat(values.astype(dtype), starts[:-1][filled])
    return out


def _check_boxes(rows: _Rows, b: Dict[str, np.ndarray], itemsizes: np.ndarray, sizes: np.ndarray,
                 nfiles: int) -> None:
    t = rows.t
    need(bool((_products(t["shape"], rows.shape_start, np.float64) < _MAX_ELEMENTS).all()),
         "a tensor's shape has too many elements")
    # each box dimension's extent in its tensor's shape
    box_of_dim = np.repeat(np.arange(len(rows.box_ndim)), rows.box_ndim)
    dim = np.arange(len(box_of_dim)) - rows.dim_start[box_of_dim]
    extent = t["shape"][rows.shape_start[rows.tensor_of_box[box_of_dim]] + dim]
    offsets, lengths = b["offsets"], b["lengths"]
    need(bool(((offsets >= 0) & (lengths >= 0) & (offsets <= extent) & (lengths <= extent - offsets)).all()),
         "a box lies outside its tensor's shape")
    elements = _products(lengths, rows.dim_start, np.int64)
    need(bool((b["nbytes"] == elements * itemsizes[t["dtype"][rows.tensor_of_box]]).all()),
         "a box's nbytes disagrees with its box")
    need(bool((b["file"] < nfiles).all()), "a box names a file the file table lacks")
    need(bool((b["nbytes"] % np.maximum(b["group"], 1) == 0).all()), "a compressed box's group does not divide it")
    stored = np.where(b["group"] > 0, _packed_sums(rows, b), b["nbytes"])
    size = sizes[np.minimum(b["file"], nfiles)]
    need(bool(((b["offset"] >= 0) & (b["offset"] <= size) & (stored <= size - b["offset"])).all()),
         "a box extends past the end of its file")
    # loads key the read-once exchange by where a box starts: two boxes there would cross its wires
    need(float(sizes[:nfiles].astype(np.float64).sum()) + nfiles < 2.0 ** 62, "files are too large")
    file_start = _starts(sizes[:nfiles] + 1)
    place = np.sort(file_start[b["file"]] + b["offset"])
    need(not bool((place[1:] == place[:-1]).any()), "two boxes start at the same place of one file")


def _packed_sums(rows: _Rows, b: Dict[str, np.ndarray]) -> np.ndarray:
    """Each compressed box's stored bytes, every chunk's length checked: from 1 byte (0 in a delta
    box: unchanged) up to the chunk's own length (stored as it is)."""
    packed, starts = b["packed"], rows.packed_start
    box = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    raw = np.minimum(rows.chunk_bytes, b["nbytes"][box] - (np.arange(len(packed)) - starts[box]) * rows.chunk_bytes)
    need(bool(((packed >= 1 - b["delta"][box]) & (packed <= raw)).all()),
         "a compressed chunk's stored length is out of range")
    total = _starts(packed)
    return total[starts[1:]] - total[starts[:-1]]


class TensorTable(Mapping):
    """The tensors of a version-2 checkpoint by key; an entry is built from the (already checked)
    columns the first time it is used, so a rank pays only for the tensors its load touches."""

    def __init__(self, keys: List[str], dtypes: List[str], files: List[str], rows: _Rows):
        self._keys, self._index = keys, dict(zip(keys, range(len(keys))))
        need(len(self._index) == len(keys), "keys names a tensor twice")
        self._dtypes, self._files = dtypes, files
        t, b = rows.t, rows.b
        self._shape, self._crcs = t["shape"], b["crc32c"]
        # the columns an entry is built from, each sliced where the entry asks (not stacked into
        # rows up front: at scale that copy alone cost a tenth of a second on every rank)
        self._tensor_columns = (t["dtype"], rows.shape_start[:-1], rows.shape_start[1:], rows.box_start[:-1],
                                rows.box_start[1:])
        self._box_columns = (b["file"], b["offset"], b["nbytes"], rows.dim_start[:-1], rows.dim_start[1:],
                             rows.crc_start[:-1], rows.crc_start[1:], b["group"], rows.packed_start[:-1],
                             rows.packed_start[1:], b["delta"])
        self._packed, self._offsets, self._lengths = b["packed"], b["offsets"], b["lengths"]
        self._dim_start = rows.dim_start  # each box's first entry in `_offsets` and `_lengths`
        self._built: Dict[str, TensorMeta] = {}
        self._file_numbers: Dict[str, int] = {}  # of the files built entries' boxes lie in

    def __getitem__(self, key: str) -> TensorMeta:
        meta = self._built.get(key)
        if meta is None:
            meta = self._built[key] = self._build(self._index[key])
        return meta

    def __contains__(self, key) -> bool:
        return key in self._index

    def positions(self) -> Tuple[List[str], Dict[str, int]]:
        """The keys in the table's order, and each key's position there (its own index: at scale,
        hundreds of thousands of keys, which a load would otherwise index again)."""
        return self._keys, self._index

    def file_numbers(self) -> Tuple[List[str], Dict[str, int]]:
        """The file table, and the number in it of each file that the boxes built so far lie in:
        those a load reads (at scale, a few of hundreds of thousands of files, which a load would
        otherwise index again)."""
        return self._files, self._file_numbers

    def _row(self, i: int) -> List[int]:
        """Tensor i's dtype, its shape's span and its boxes' span."""
        return [int(column[i]) for column in self._tensor_columns]

    def describe(self, key: str) -> Tuple[Tuple[int, ...], str, int]:
        """A tensor's shape, dtype and box count, without building its boxes."""
        dtype, s0, s1, first, last = self._row(self._index[key])
        return tuple(self._shape[s0:s1].tolist()), self._dtypes[dtype], last - first

    def extents(self, key: str) -> np.ndarray:
        """Each box's offsets and lengths, shape (boxes, ndim, 2), straight from the columns: a
        load searches a tensor of thousands of boxes with them, without building its entry."""
        _, s0, s1, first, last = self._row(self._index[key])
        d0 = int(self._dim_start[first])
        d1 = d0 + (last - first) * (s1 - s0)
        return np.stack([self._offsets[d0:d1], self._lengths[d0:d1]], axis=1).reshape(last - first, s1 - s0, 2)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def _build(self, i: int) -> TensorMeta:
        dtype, s0, s1, first, last = self._row(i)
        shape = tuple(self._shape[s0:s1].tolist())
        rows = list(zip(*(column[first:last].tolist() for column in self._box_columns)))
        if not rows:
            return TensorMeta(shape=shape, dtype=self._dtypes[dtype], boxes=[])
        d, c = rows[0][3], rows[0][5]
        offsets, lengths = self._offsets[d:rows[-1][4]].tolist(), self._lengths[d:rows[-1][4]].tolist()
        crcs = self._crcs.values(c, rows[-1][6])
        self._file_numbers.update((self._files[row[0]], row[0]) for row in rows)
        boxes = [StoredBox(file=self._files[f], offset=offset, nbytes=nbytes, crc32c=crcs[c0 - c:c1 - c],
                           group=group, packed=self._packed[p0:p1].tolist() if group else [], delta=bool(delta),
                           offsets=tuple(offsets[d0 - d:d1 - d]), lengths=tuple(lengths[d0 - d:d1 - d]))
                 for f, offset, nbytes, d0, d1, c0, c1, group, p0, p1, delta in rows]
        return TensorMeta(shape=shape, dtype=self._dtypes[dtype], boxes=boxes)
