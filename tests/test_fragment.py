"""Flat-range decomposition and box helpers: properties over random shapes and ranges."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_plugins._src.fragment import (box_fragment, flat_fragments, flat_offset, flat_range_boxes,
                                   intersect, packed_pieces, piece_fragments)
from ckpt_plugins._src.plan import box_difference

shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple)


@st.composite
def shape_and_range(draw):
    shape = draw(shapes)
    total = math.prod(shape)
    start = draw(st.integers(0, total))
    end = draw(st.integers(start, total))
    return shape, start, end


@settings(max_examples=400, deadline=None)
@given(shape_and_range())
def test_boxes_tile_the_range_in_order(case):
    shape, start, end = case
    boxes = flat_range_boxes(shape, start, end)
    assert len(boxes) <= 2 * len(shape) - 1
    position = start
    for offsets, lengths in boxes:
        assert all(0 <= o and o + n <= s and n > 0 for o, n, s in zip(offsets, lengths, shape))
        # each box is contiguous in row-major order and begins where the previous one ended
        assert flat_offset(shape, offsets) == position
        position += math.prod(lengths)
        last = [o + n - 1 for o, n in zip(offsets, lengths)]
        assert flat_offset(shape, last) == position - 1
    assert position == end


@settings(max_examples=200, deadline=None)
@given(shape_and_range())
def test_fragments_are_views_of_the_flat_buffer(case):
    shape, start, end = case
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    flat = full.reshape(-1)[start:end].clone()
    frags = flat_fragments("t", shape, flat, start, end)
    for frag in frags:
        assert frag.local.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        region = full[tuple(slice(o, o + n) for o, n in zip(frag.offsets, frag.lengths))]
        assert torch.equal(frag.local, region)
    assert sum(f.local.numel() for f in frags) == end - start
    if frags:  # writing through a fragment writes the flat buffer
        frags[0].local.fill_(-1.0)
        assert flat[0].item() == -1.0


def test_flat_range_rejects_out_of_bounds():
    with pytest.raises(ValueError, match="outside a tensor of 6 elements"):
        flat_range_boxes((2, 3), 2, 7)


def test_flat_range_example_from_fsdp1():
    # rank 0 of 3 holds rows 0..2 plus the start of row 3 of a (5, 4) weight
    assert flat_range_boxes((5, 4), 0, 14) == [((0, 0), (3, 4)), ((3, 0), (1, 2))]
    assert flat_range_boxes((5, 4), 14, 20) == [((3, 2), (1, 2)), ((4, 0), (1, 4))]
    assert flat_range_boxes((2, 3, 4), 5, 19) == [((0, 1, 1), (1, 1, 3)), ((0, 2, 0), (1, 1, 4)),
                                                  ((1, 0, 0), (1, 1, 4)), ((1, 1, 0), (1, 1, 3))]


def test_packed_fragments_skip_alignment_gaps():
    entries = [("a", (2, 3), 0), ("b", (4,), 8)]  # elements 6, 7 are alignment padding
    packed = torch.arange(12.0)
    frags = piece_fragments(packed_pieces(entries, 5, 10), packed[5:10])
    assert [(f.key, f.offsets, f.lengths) for f in frags] == [("a", (1, 2), (1, 1)), ("b", (0,), (2,))]
    assert frags[1].local.tolist() == [8.0, 9.0]


def test_box_fragment_clips_padding():
    padded = torch.arange(12.0).reshape(4, 3)  # vocab padded from 10 rows to 12 over 3 ranks
    frag = box_fragment("emb", (10, 3), (8, 0), padded)
    assert frag.lengths == (2, 3) and torch.equal(frag.local, padded[:2])
    assert box_fragment("emb", (10, 3), (10, 0), padded) is None


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_box_difference_partitions(data):
    shape = data.draw(shapes)
    box = tuple(zip(*[(data.draw(st.integers(0, s - 1)), s) for s in shape]))
    box = (box[0], tuple(s - o for o, s in zip(box[0], shape)))
    cut_offs = tuple(data.draw(st.integers(o, o + n - 1)) for o, n in zip(*box))
    cut = (cut_offs, tuple(data.draw(st.integers(1, o + n - c)) for o, n, c in zip(*box, cut_offs)))
    pieces = box_difference(box, cut)
    assert len(pieces) <= 2 * len(shape)
    covered = torch.zeros(shape, dtype=torch.int32)
    for offs, lens in pieces + [cut]:
        covered[tuple(slice(o, o + n) for o, n in zip(offs, lens))] += 1
    expect = torch.zeros(shape, dtype=torch.int32)
    expect[tuple(slice(o, o + n) for o, n in zip(*box))] = 1
    assert torch.equal(covered, expect)
    assert intersect(box, cut) == cut
