"""Compare a checkpoint, key by key, with another checkpoint of any format, layout and framework
(`bcp diff`), or with a live state: the check for conversion chains built by hand.

Values stream through in slabs of rows (`slab_bytes` per side, as float64), whatever the layouts:
each side is read through the load plan, so a box of one checkpoint is compared with the same
region of the other however either was sharded. One process, no process group.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .committed import check_files, read_metadata, read_object
from .fragment import Box, Fragment, sub_view
from .offline import read_box
from .state import root_handler
from .storage import storage_for

SLAB_BYTES = 64 << 20
STATUSES = ("different", "shape", "only in a", "only in b", "equal")


@dataclass
class KeyDiff:
    """One key: `status` is equal, different, shape (shapes differ: values not compared), only in
    a, or only in b. A different tensor gets its largest absolute and relative differences, how
    many elements differ, the first one's index and the stored box of `a` holding it (the live
    fragment's, when `b` is a state)."""
    key: str
    status: str
    kind: str = "tensor"  # or "object"
    a: str = ""  # shape and dtype, as each side holds it
    b: str = ""
    max_abs: float = 0.0
    max_rel: float = 0.0
    differing: int = 0
    elements: int = 0
    first_index: Optional[List[int]] = None
    first_box: Optional[Dict[str, List[int]]] = None

    def line(self) -> str:
        text = f"{self.status:<10} {self.key}"
        if self.status == "different" and self.kind == "tensor":
            box = self.first_box or {}
            text += (f": max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}, {self.differing:,} of "
                     f"{self.elements:,} elements; first at {self.first_index} in box at {box.get('offsets')} of "
                     f"{box.get('lengths')}")
        elif self.status == "shape" or self.a != self.b and self.a and self.b:
            text += f": {self.a} vs {self.b}"
        return text


@dataclass
class DiffReport:
    """Every compared key of `a` and `b` (paths; "state" for a live one), different ones first."""
    a: str
    b: str
    atol: float
    rtol: float
    keys: List[KeyDiff] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return all(k.status == "equal" for k in self.keys)

    def counts(self) -> Dict[str, int]:
        return {s: sum(k.status == s for k in self.keys) for s in STATUSES}

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "equal": self.equal, "counts": self.counts()}

    def lines(self) -> List[str]:
        counts = ", ".join(f"{n} {s}" for s, n in self.counts().items() if n)
        return [f"{self.a} vs {self.b}: {counts or 'no keys'}"] + [
            "  " + k.line() for k in self.keys if k.status != "equal"]


def diff(a, b, *, atol: float = 0.0, rtol: float = 0.0, keys: Optional[str] = None,
         slab_bytes: int = SLAB_BYTES) -> DiffReport:
    """Compare checkpoint `a` with checkpoint `b` (a path) or a live state (a dict, as passed to
    `save`: what this process holds of it). Equal means bit for bit, unless `atol`/`rtol` allow a
    difference (as `torch.isclose`, NaNs equal). `keys`: a glob (`model/*experts*`) choosing keys."""
    storage, metadata = _open(a)
    report = DiffReport(str(a), "state" if isinstance(b, dict) else str(b), atol, rtol)
    left = _Side(storage, metadata, slab_bytes)
    right: Any = _Live(b) if isinstance(b, dict) else _Side(*_open(b), slab_bytes)
    for key in sorted(set(left.keys()) | set(right.keys())):
        if keys is not None and not fnmatch.fnmatchcase(key, keys):
            continue
        if key not in right.keys() or key not in left.keys():
            side = left if key in left.keys() else right
            report.keys.append(KeyDiff(key, "only in a" if side is left else "only in b", side.kind(key)))
        elif left.kind(key) == "object" or right.kind(key) == "object":
            same = left.kind(key) == right.kind(key) and _same(left.object(key), right.object(key))
            report.keys.append(KeyDiff(key, "equal" if same else "different", "object"))
        else:
            report.keys.append(_tensors(key, left, right, atol, rtol, slab_bytes))
    report.keys.sort(key=lambda k: (STATUSES.index(k.status), k.key))
    return report


def _open(path) -> Tuple[Any, Any]:
    storage = storage_for(path)
    metadata = read_metadata(storage)
    check_files(storage, metadata)
    return storage, metadata


class _Side:
    """A checkpoint: its tensors (aliases resolved) and replicated objects."""

    def __init__(self, storage, metadata, slab_bytes: int):
        self.storage, self.metadata, self.slab_bytes = storage, metadata, slab_bytes
        skip = set(getattr(metadata, "descriptive", ()))
        self.tensors = {k: k for k in metadata.tensors} | dict(metadata.aliases)
        self.objects = {k for k, v in metadata.objects.items() if k not in skip and any(o.rank is None for o in v)}

    def keys(self):
        return self.tensors.keys() | self.objects

    def kind(self, key: str) -> str:
        return "tensor" if key in self.tensors else "object"

    def object(self, key: str) -> Any:
        return read_object(self.storage, self.metadata, key, None)

    def meta(self, key: str):
        return self.metadata.tensors[self.tensors[key]]

    def describe(self, key: str) -> str:
        meta = self.meta(key)
        return f"{list(meta.shape)} {meta.dtype}"

    def shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self.meta(key).shape)

    def boxes(self, key: str) -> List[Box]:
        """Where the values lie: the master's boxes for a weight stored as its cast."""
        stored = self.tensors[key]
        meta = self.metadata.tensors[self.metadata.casts.get(stored, stored)]
        return [(tuple(b.offsets), tuple(b.lengths)) for b in meta.boxes]

    def read(self, key: str, box: Box) -> torch.Tensor:
        return read_box(self.storage, self.metadata, self.tensors[key], box[0], box[1])


class _Live:
    """What this process holds of a live state, as a save would describe it."""

    def __init__(self, state: Dict[str, Any]):
        items = root_handler(state).save_items("")
        self.fragments: Dict[str, List[Fragment]] = {}
        for frag in items.fragments:
            self.fragments.setdefault(frag.key, []).append(frag)
        self.objects = items.objects

    def keys(self):
        return self.fragments.keys() | self.objects.keys()

    def kind(self, key: str) -> str:
        return "tensor" if key in self.fragments else "object"

    def object(self, key: str) -> Any:
        return self.objects[key]

    def describe(self, key: str) -> str:
        f = self.fragments[key][0]
        return f"{list(f.global_shape)} {str(f.dtype).replace('torch.', '')}"

    def shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self.fragments[key][0].global_shape)

    def boxes(self, key: str) -> List[Box]:
        return [(tuple(f.offsets), tuple(f.lengths)) for f in self.fragments[key]]

    def read(self, key: str, box: Box) -> torch.Tensor:
        frag = next(f for f in self.fragments[key] if _inside(box, (tuple(f.offsets), tuple(f.lengths))))
        return sub_view(frag.local, frag.offsets, box).detach().cpu()


def _tensors(key: str, left: _Side, right, atol: float, rtol: float, slab_bytes: int) -> KeyDiff:
    out = KeyDiff(key, "equal", a=left.describe(key), b=right.describe(key))
    if left.shape(key) != right.shape(key):
        out.status = "shape"
        return out
    # the regions the live side holds (all of the tensor for a checkpoint), each compared slab by slab
    regions = right.boxes(key) if isinstance(right, _Live) else [((0,) * len(left.shape(key)), left.shape(key))]
    boxes = left.boxes(key) if isinstance(right, _Side) else regions
    for region in regions:
        for slab in _slabs(region, slab_bytes):
            _tally(out, slab, left.read(key, slab), right.read(key, slab), atol, rtol, boxes)
    if out.differing:
        out.status = "different"
    return out


def _slabs(box: Box, slab_bytes: int) -> Iterator[Box]:
    offsets, lengths = box
    if not lengths:
        yield box
        return
    rows = max(1, slab_bytes // max(1, math.prod(lengths[1:]) * 8))
    for r in range(0, lengths[0], rows):
        yield (offsets[0] + r,) + tuple(offsets[1:]), (min(rows, lengths[0] - r),) + tuple(lengths[1:])


def _tally(out: KeyDiff, slab: Box, a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float,
           boxes: Sequence[Box]) -> None:
    out.elements += a.numel()
    if not a.numel():
        return
    exact = a.dtype == b.dtype and atol == 0 and rtol == 0  # bit for bit: NaN payloads and -0.0 count
    wide = None if exact else (_wide(a).reshape(-1), _wide(b).reshape(-1))
    differs = (_bytes(a) != _bytes(b)).any(dim=1) if exact else ~torch.isclose(
        *wide, rtol=rtol, atol=atol, equal_nan=True)
    count = int(differs.sum())
    if not count:
        return
    wa, wb = wide or (_wide(a).reshape(-1), _wide(b).reshape(-1))
    wa, wb = wa[differs], wb[differs]
    gap = (wa - wb).abs().nan_to_num(nan=math.inf)
    rel = gap / wb.abs()
    out.max_abs = max(out.max_abs, float(gap.max()))
    out.max_rel = max(out.max_rel, float(rel.nan_to_num(nan=math.inf).max()))
    if out.first_index is None:
        flat = int(differs.nonzero()[0])
        index = [o + i for o, i in zip(slab[0], _unravel(flat, slab[1]))]
        box = next(bx for bx in boxes if _inside((tuple(index), (1,) * len(index)), bx))
        out.first_index, out.first_box = index, {"offsets": list(box[0]), "lengths": list(box[1])}
    out.differing += count


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8).reshape(t.numel(), t.element_size())


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def _unravel(flat: int, shape: Sequence[int]) -> List[int]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return index[::-1]


def _inside(inner: Box, outer: Box) -> bool:
    return all(o <= i and i + n <= o + m for i, n, o, m in zip(inner[0], inner[1], outer[0], outer[1]))


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                and x.shape == y.shape and torch.equal(_bytes(x.detach().cpu()), _bytes(y.detach().cpu())))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same(u, v) for u, v in zip(x, y))
    return type(x) is type(y) and x == y
