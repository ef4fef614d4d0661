"""Sorting the rows of a plan on several integer columns at once."""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np


def lexsorted(keys: Sequence[np.ndarray]) -> np.ndarray:
    """`np.lexsort(keys)`'s order (the last key first, ties kept in place) for integer keys, from
    one stable sort of the keys packed into one int64 where their ranges' bits fit: several times
    faster, and fastest on the long sorted runs a plan's rows come in (a merge sort finds them)."""
    spans = [(int(k.min()), int(k.max())) if len(k) else (0, 0) for k in keys]
    widths = [(high - low).bit_length() for low, high in spans]
    if sum(widths) > 63:
        return np.lexsort(keys)
    packed = np.zeros(len(keys[0]) if len(keys) else 0, dtype=np.int64)
    for k, (low, _), width in zip(reversed(keys), reversed(spans), reversed(widths)):
        packed = (packed << width) | (np.asarray(k, dtype=np.int64) - low)
    return np.argsort(packed, kind="stable")


def distinct(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """`np.unique(values, return_index=True, return_inverse=True)` for a 1-D int64 or uint64
    column, as (inverse, index): each row's number among the distinct values in ascending order,
    and each distinct value's first row. From one value sort (several times faster than the index
    sort np.unique makes) of each value's high bits with its row number in the low bits; rows
    whose high bits tie while their values differ (for hashes, rare and few) are then sorted by
    value."""
    n = len(values)
    ordered = values.view(np.uint64)
    if values.dtype.kind == "i":
        ordered = ordered ^ np.uint64(1 << 63)  # signed order, as unsigned
    bits = np.uint64(max(1, (n - 1).bit_length()))
    high = ordered >> bits
    order = (np.sort((high << bits) | np.arange(n, dtype=np.uint64)) & ~(~np.uint64(0) << bits)).astype(np.int64)
    value, high = ordered[order], high[order]
    tied = np.flatnonzero((high[1:] == high[:-1]) & (value[1:] != value[:-1]))
    if len(tied):
        at = np.flatnonzero(np.isin(high, high[tied]))  # whole runs of those high bits, in place
        order[at] = order[at[np.lexsort((order[at], value[at]))]]
        value = ordered[order]
    new = _changes(value)
    number = np.empty(n, dtype=np.int64)
    number[order] = np.cumsum(new) - 1
    return number, order[new]


def first_met(number: np.ndarray, first: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Renumbers distinct values (`number` of each row, `first` row of each) as first met in the
    rows, in one pass over them."""
    met = np.zeros(len(number), dtype=bool)
    met[first] = True
    renumbered = np.cumsum(met) - 1
    return renumbered[first][number], np.flatnonzero(met)


def firsts(values: np.ndarray) -> np.ndarray:
    """For sorted `values`, each one's index of the first equal to it (`np.searchsorted(values,
    values)`), in one pass instead of a binary search each."""
    return np.maximum.accumulate(np.where(_changes(values), np.arange(len(values)), 0))


def _changes(values: np.ndarray) -> np.ndarray:
    """Where a sorted column's value differs from the one before it (its first row included)."""
    new = np.ones(len(values), dtype=bool)
    np.not_equal(values[1:], values[:-1], out=new[1:])
    return new
