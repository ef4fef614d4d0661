"""Save and load planning as pure functions: no processes, no I/O."""
import numpy as np
import pytest

from ckpt_plugins._src.errors import LoadMismatchError
from ckpt_plugins._src.packing import Joined, gathered
from ckpt_plugins._src.plan import TensorSpec, plan_load
from ckpt_plugins._src.plan_cache import Structure, _request
from ckpt_plugins._src.runs import run_groups
from ckpt_plugins._src.save_plan import plan_save, spec_runs
from ckpt_plugins._src.save_request import PlanRequests, joined_runs, runs_message, shares_asked, stretches_asked
from ckpt_plugins._src.spec_table import SpecTable


def spec(key, shape, offsets=None, lengths=None, dtype="float32"):
    return TensorSpec(key, shape, dtype, offsets or (0,) * len(shape), lengths or shape)


def delivered(blobs, what="messages"):
    """`blobs` as a gather delivers them to the coordinator or every rank (`Coordinator.gather_bytes`)."""
    return Joined.gathered(gathered(blobs), len(blobs), what)


def planned(ranks, files_per_rank=1, digests=None, **kwargs):
    """`plan_save` of every rank's spec list; with their runs (`digests`), from what the
    coordinator gathers: each distinct run's specs once, in shares from its holders."""
    if digests is None:
        return plan_save(SpecTable.of(ranks), run_groups(None, [len(r) for r in ranks]), files_per_rank, **kwargs)
    groups = joined_runs(delivered([runs_message(r) for r in digests]))
    sent = [_request(Structure(specs, {}, []), stretches_asked(a)).packed()
            for specs, a in zip(ranks, shares_asked(groups))]
    return plan_save(PlanRequests.of(delivered(sent)).specs, groups, files_per_rank, **kwargs)


def test_replicated_boxes_are_written_once_and_balanced():
    model = [spec(f"layer{i}", (256, 256 + (i % 3))) for i in range(24)]
    plan = planned([model] * 4, files_per_rank=2)
    print(f"byte balance max/mean over 4 ranks, 24 tensors: {plan.balance:.3f}")
    assert plan.balance < 1.25
    writes = [w for ws in plan.writes for w in ws]
    assert len(writes) == 24  # each distinct box once
    assert all(len(t.boxes) == 1 for t in plan.metadata.tensors.values())
    assert sum(plan.metadata.files.values()) == sum(s.nbytes for s in model)


def test_runs_replicas_hold_alike_are_planned_once_with_the_same_plan():
    """Data-parallel replicas: the same weights, each its own optimizer shard. Planned by runs
    (`spec_runs`: the weights once), the plan is the one planned spec by spec."""
    weights = [spec(f"model/w{i}", (64, 48 + i)) for i in range(5)]
    ranks = [weights + [spec("optim/w0/exp_avg", (64, 48), (16 * r, 0), (16, 48)),
                        spec("optim/w1/exp_avg", (64, 49), (16 * r, 0), (16, 49))] for r in range(4)]
    ranks[3] = ranks[3][:-1] + [spec("optim/w1/exp_avg", (64, 49), (48, 0), (16, 49)), spec("optim/b", (3,))]
    runs = [spec_runs(r) for r in ranks]
    assert [n for _, n in runs[0]] == [5, 2] and len({r[0] for r in runs}) == 1 and len({r[1] for r in runs}) == 4
    # what the coordinator gathers: each distinct run's specs once, the weights' in shares over the replicas
    asked = [stretches_asked(a) for a in shares_asked(joined_runs(delivered([runs_message(r) for r in runs])))]
    assert asked == [[(0, 1), (5, 2)], [(1, 1), (5, 2)], [(2, 1), (5, 2)], [(3, 2), (5, 3)]]
    by_runs, by_specs = planned(ranks, 2, digests=runs), planned(ranks, 2)
    assert by_runs.metadata == by_specs.metadata and by_runs.writes == by_specs.writes
    assert sum(len(w) for w in by_runs.writes) == 5 + 4 * 2 + 1  # every weight once


def test_run_groups_number_runs_as_first_met_and_check_they_cover_each_rank():
    from ckpt_plugins._src.runs import Run, run_groups
    a, b, c = (bytes([i]) * 32 for i in range(3))
    groups = run_groups([[Run(b, 1), Run(a, 2)], [], [Run(c, 3), Run(b, 1), Run(b, 1)], [Run(a, 2), Run(b, 1)]], [3, 0, 5, 3])
    assert groups.group.tolist() == [0, 1, 2, 0, 0, 1, 0] and groups.first.tolist() == [0, 1, 2]
    assert groups.rank.tolist() == [0, 0, 2, 2, 2, 3, 3] and groups.start.tolist() == [0, 1, 0, 3, 4, 0, 2]
    order, bounds = groups.holders
    assert [order[x:y].tolist() for x, y in zip(bounds[:-1], bounds[1:])] == [[0, 3, 4, 6], [1, 5], [2]]
    # what each rank sends of its runs: an equal share of each (group 0's one item goes with its last holder)
    assert [groups.share(r).tolist() for r in range(4)] == [[1], [], [0, 1, 2], [1, 2]]
    sent = np.concatenate([groups.share(r) + (0, 3, 3, 8)[r] for r in range(4)])  # in the ranks' lists joined
    assert groups.share_positions().tolist() == sent.tolist() == [1, 3, 4, 5, 9, 10]
    assert groups.share_groups().tolist() == [1, 2, 2, 2, 1, 0]
    with pytest.raises(ValueError, match="rank 1's run digests cover 2 of 3 items"):
        run_groups([[Run(a, 3)], [Run(a, 2)]], [3, 3])
    with pytest.raises(ValueError, match="runs of one digest differ in length"):
        run_groups([[Run(a, 3)], [Run(a, 2)]], [3, 2])


def test_regions_travel_packed_and_come_back_as_they_were():
    from ckpt_plugins._src.read_once import Regions
    regions = [(((0, 4), (2, 3)), ((2, 0), (1, 8))), (), (((), ()),), (((2**40,), (3,)),), (((5,), (1,)),)]
    packed = Regions.of(regions)
    assert [packed[i] for i in range(len(packed))] == regions and packed.data.dtype == np.int64
    assert list(map(packed.take(np.array([4, 0, 1], dtype=np.int64)).__getitem__, range(3))) == [
        regions[4], regions[0], regions[1]]
    assert Regions.of(regions[:3]).data.dtype == np.int32  # values that fit go in half the bytes


def test_requests_travel_as_bytes_and_join_as_they_were():
    """Each rank's read requests and load request as bytes (`packed`), every rank's joined in one
    pass (`RankReads.unpacked`, `LoadRequests.of`, `ShareRequests.of`): the same requests in rank
    order, whatever each rank's regions' width, however many it sent, with or without its reads,
    host, missing keys; the keys several ranks use alike sent once."""
    import pickle
    from ckpt_plugins._src.load_request import ShareRequests, LoadRequest, LoadRequests, key_runs
    from ckpt_plugins._src.read_once import RankReads, ReadRequest as R
    from ckpt_plugins._src.runs import runs_of
    files = ["a", "b"]
    sent = [[R("a", 0, 0, 8, (((1, 2), (3, 4)),))], [],
            [R("b", 2**40, 5, 2**35, (((0,), (2**33,)), ((), ()))), R("a", 7, 1, 2, ())],  # int64 regions
            [R("a", 3, 0, 1, ()), R("b", 0, 0, 9, (((0, 0, 0), (1, 2, 3)),))]]
    reads = [RankReads.of(q, {"a": 0, "b": 1}) for q in sent]
    with pytest.raises(LoadMismatchError, match="reads of b, which the checkpoint's file table lacks"):
        RankReads.of(sent[2], {"a": 0, "c": 1})
    blobs = [r.packed() for r in reads]
    assert all(type(pickle.loads(pickle.dumps(b))) is bytes for b in blobs)  # nothing to rebuild but bytes
    joined = Joined(blobs, "read requests")
    for every in RankReads.unpacked(joined, joined.start, joined.size, [1, 0, 2, 2]), RankReads.joined(reads):
        assert [every.request(i, files) for i in range(len(every))] == [q for q in sent for q in q]
    narrow = Joined([blobs[0], blobs[1], blobs[3]], "read requests")  # int32 regions: read in place
    every = RankReads.unpacked(narrow, narrow.start, narrow.size, [1, 0, 2])
    assert [every.request(i, files) for i in range(3)] == sent[0] + sent[3] and every.regions.data.dtype == np.int32
    one = Joined(blobs[:1], "read requests")
    with pytest.raises(ValueError, match="rank 2 sent 112 bytes that do not hold its 1 read requests"):
        RankReads.unpacked(joined, joined.start, joined.size, [1, 0, 1, 2])
    with pytest.raises(ValueError, match="rank 0 sent 64 bytes for 2 read requests"):
        RankReads.unpacked(one, one.start, one.size, [2])

    keys = ["model/a", "model/b", "model/c", "model/d", "optim/a"]
    requests = [LoadRequest(np.array([r, 4], dtype=np.int32), key_runs(keys, np.array([r, 4])), [],
                            runs_of(["model/w"] * len(q), q), reads[r], f"host-{r // 2}", "ckpt") for r, q in enumerate(sent)]
    requests[1].missing, requests[3].missing, requests[2].host = ["x/\u00e9"], ["y", "x/\u00e9"], None
    every = LoadRequests.of(delivered([r.packed() for r in requests]))
    assert every.hosts == ["host-0", "host-0", None, "host-1"] and every.paths == ["ckpt"]
    assert every.missing == ["x/\u00e9", "y"] and sorted(every.used.tolist()) == [0, 1, 2, 3, 4, 4, 4, 4]
    assert [every.reads.request(i, files) for i in range(len(every.reads))] == [q for q in sent for q in q]
    assert every.runs.rank.tolist() == [0, 2, 3] and every.runs.count.tolist() == [1, 2, 2]
    requests[0].reads, requests[3].path = None, "other"  # one rank without its reads: none are used
    requests[2].wanted = np.array([1, 4], dtype=np.int32)  # alike to rank 1's: their holders share the sending
    requests[2].key_runs = key_runs(keys, requests[2].wanted)
    every = LoadRequests.of(delivered([r.packed() for r in requests]))
    assert every.reads is None and every.used is None and every.paths == ["ckpt", "other"]
    assert every.key_runs.group.tolist() == [0, 1, 2, 1, 2, 1, 3, 1] and every.key_runs.count.tolist() == [1] * 8
    shares = [ShareRequests.mine(r, reads[k], every, k) for k, r in enumerate(requests)]
    assert [m.keys.tolist() for m in shares] == [[0], [], [1], [3, 4]] and [len(m.reads) for m in shares] == [1, 0, 2, 2]
    joined = ShareRequests.of(delivered([m.packed() for m in shares]), every)
    assert joined.keys.tolist() == [0, 1, 3, 4]
    assert [joined.reads.request(i, files) for i in range(len(joined.reads))] == [q for q in sent for q in q]
    with pytest.raises(ValueError, match="rank 3 sent 0 bytes, short of the 8 bytes of its 2 key indices"):
        ShareRequests.of(delivered([m.packed() for m in shares[:3]] + [b""]), every)
    with pytest.raises(ValueError, match="rank 1 sent 176 bytes that do not hold its load request"):
        LoadRequests.of(delivered([requests[0].packed(), requests[1].packed()[:-8]]))


def test_offsets_are_fixed_and_disjoint_within_each_file():
    shards = [[spec("w", (10, 4), (5 * r, 0), (5, 4)), spec("b", (3,))] for r in range(2)]
    plan = planned(shards, files_per_rank=2)
    spans = {}
    for entries in plan.stored:
        for e in entries:
            spans.setdefault(e.file, []).append((e.offset, e.offset + e.nbytes))
    for file, ranges in spans.items():
        ranges.sort()
        assert ranges[0][0] == 0 and all(-(-a[1] // 64) * 64 == b[0] for a, b in zip(ranges, ranges[1:]))
        assert plan.metadata.files[file] == ranges[-1][1]
    assert [(b.offsets, b.lengths) for b in plan.metadata.tensors["w"].boxes] == [((0, 0), (5, 4)), ((5, 0), (5, 4))]


def test_ranks_disagreeing_on_a_tensor_is_an_error():
    with pytest.raises(ValueError, match=r"w: ranks disagree .* rank 1 holds shape \[4, 4\]"):
        planned([[spec("w", (4, 3))], [spec("w", (4, 4))]])
    with pytest.raises(ValueError, match=r"w: ranks disagree .* bfloat16, rank 2 holds shape \[4, 3\] float32"):
        planned([[spec("w", (4, 3), dtype="bfloat16")]] * 2 + [[spec("w", (4, 3))]])
    with pytest.raises(ValueError, match=r"w: rank 0's box \(\(3, 0\), \(2, 3\)\) lies outside shape \[4, 3\]"):
        planned([[spec("w", (4, 3), (3, 0), (2, 3))]])
    with pytest.raises(ValueError, match=r"w: rank 1's box of -1 dimensions lies outside shape \[4, 3\]"):
        planned([[spec("v", (2,))], [spec("v", (2,)), spec("w", (4, 3), (0, 0), (4,))]])


def test_specs_travel_as_columns_and_plan_as_they_were(monkeypatch):
    """The specs a rank sends the coordinator, as bytes, joined: back as they were; a message
    that does not hold them is named; keys whose digests clash are refused, and boxes and runs
    whose 64-bit hashes clash are still told apart."""
    from ckpt_plugins._src import runs, spec_table
    from ckpt_plugins._src.save_request import PlanRequest
    ranks = [[spec("model/é", (6, 5, 4), (2 * r, 0, 0), (2, 5, 4), dtype="bfloat16"), spec("b", (3,)),
              spec("s", ())] for r in range(3)] + [[]]
    table = SpecTable.of(ranks)
    assert table.count.tolist() == [3, 3, 3, 0] and table.shape.shape == (9, 3)
    assert [table.key(i) for i in range(3)] == ["model/é", "b", "s"] and table.box(3) == ((2, 0, 0), (2, 5, 4))
    assert table.lengths[2].tolist() == [1, 1, 1] and table.ndim.tolist()[:3] == [3, 1, 0]
    sent = [PlanRequest(spec_table.packed_specs(r), {"a": "b"} if i == 1 else {}, ["x"] * i, i != 3).packed()
            for i, r in enumerate(ranks)]
    joined = PlanRequests.of(delivered(sent))
    assert joined.aliases == {"a": "b"} and joined.objects == [[], ["x"], ["x", "x"], ["x", "x", "x"]]
    assert not joined.casts and all(np.array_equal(getattr(joined.specs, c), getattr(table, c))
                                    for c in ("digest", "dtype", "ndim", "shape", "offsets", "lengths", "count"))
    with pytest.raises(ValueError, match="rank 1 sent 24 bytes, short of its tensor specs' header"):
        SpecTable.unpacked(Joined([sent[0], sent[1][:56]], "x"), np.array([32, len(sent[0]) + 32]), np.array([
            len(sent[0]) - 32, 24]))
    with pytest.raises(ValueError, match=r"rank 2 sent \d+ bytes that do not hold its plan request"):
        PlanRequests.of(delivered(sent[:2] + [sent[2][:-8]]))
    plan = planned(ranks, 2)
    monkeypatch.setattr(runs, "_row_hash", lambda columns: np.zeros(len(columns), dtype=np.uint64))
    assert planned(ranks, 2).metadata == plan.metadata  # every box's and run's hash alike: told apart on their columns
    monkeypatch.setattr(spec_table, "key_digest", lambda key: bytes(16))
    with pytest.raises(ValueError, match="tensor keys b and model/é share a digest"):
        planned(ranks)


def test_items_are_dealt_biggest_first_over_a_ranks_files_and_aligned():
    from ckpt_plugins._src.save_plan import PAGE, PAGE_ITEM_BYTES, placement
    rank = np.array([1, 0, 0, 0, 0, 1, 0])
    nbytes = np.array([10, 5, PAGE_ITEM_BYTES + 1, 100, 70, 3, PAGE_ITEM_BYTES])
    order, file, offset = placement(rank, nbytes, 2, spread=0)
    # rank 0 by size: 2, 6 (page aligned), 3, 4, 1: dealt to files 0, 1, 1, 0, 0
    assert order.tolist() == [2, 4, 1, 6, 3, 0, 5] and file.tolist() == [0, 0, 0, 1, 1, 0, 1]
    assert offset.tolist() == [0, PAGE_ITEM_BYTES + PAGE, PAGE_ITEM_BYTES + PAGE + 128, 0, PAGE_ITEM_BYTES, 0, 0]
    # a rank saving less than `spread` in all (rank 1: 13 bytes) writes one file
    order, file, offset = placement(rank, nbytes, 2, spread=200)
    assert order.tolist() == [2, 4, 1, 6, 3, 0, 5] and file.tolist() == [0, 0, 0, 1, 1, 0, 0]
    assert offset.tolist() == [0, PAGE_ITEM_BYTES + PAGE, PAGE_ITEM_BYTES + PAGE + 128, 0, PAGE_ITEM_BYTES, 0, 64]


def test_load_plan_reads_only_the_chunks_it_needs():
    stored = planned([[spec("w", (4096, 1024))]]).metadata  # 16 MiB in one box
    plan = plan_load(stored, [spec("w", (4096, 1024), (1024, 0), (1024, 1024))])  # rows 1024..2047
    (read,) = plan.reads
    assert (read.start, read.end) == (4 << 20, 8 << 20)
    assert plan.read_bytes == 4 << 20


def test_load_plan_merges_reads_of_one_stored_box():
    stored = planned([[spec("qkv", (12, 4))]]).metadata
    wanted = [spec("qkv", (12, 4), (0, 0), (4, 4)), spec("qkv", (12, 4), (4, 0), (8, 4))]
    plan = plan_load(stored, wanted)
    assert len(plan.reads) == 1 and len(plan.reads[0].copies) == 2


def test_load_plan_coverage_and_missing():
    stored = planned([[spec("w", (8, 2), (0, 0), (4, 2))], [spec("w", (8, 2), (6, 0), (2, 2))]]).metadata
    with pytest.raises(LoadMismatchError, match=r"w: no stored box covers region offsets \[4, 0\] lengths \[2, 2\]"):
        plan_load(stored, [spec("w", (8, 2))])
    assert plan_load(stored, [spec("nope", (1,))]).missing == ["nope"]


def test_big_replicated_boxes_are_split_across_their_holders():
    big = spec("emb", (4096, 4096))  # 64 MiB held by 4 ranks: 4 row ranges, one per rank
    plan = planned([[big]] * 4)
    boxes = plan.metadata.tensors["emb"].boxes
    assert [(b.offsets, b.lengths) for b in boxes] == [((i * 1024, 0), (1024, 4096)) for i in range(4)]
    assert plan.rank_bytes == [16 << 20] * 4 and plan.balance == 1.0
    assert sorted(w.box for ws in plan.writes for w in ws) == [(b.offsets, b.lengths) for b in boxes]
    assert len(planned([[big]]).metadata.tensors["emb"].boxes) == 1  # one holder: nothing to split


def assign(requests, runs=None, *args, **kwargs):
    """The read-once assignment of each rank's list of `ReadRequest`s; with their `runs_of`, as a
    load exchanges them (each rank sends its `reads_share`)."""
    from ckpt_plugins._src.read_once import RankReads, assign_transfers, reads_share
    from ckpt_plugins._src.runs import run_groups
    files = sorted({r.file for reqs in requests for r in reqs})
    reads = [RankReads.of(r, {f: i for i, f in enumerate(files)}) for r in requests]
    groups = run_groups(runs, [len(r) for r in reads])
    reads = RankReads.joined([reads_share(r, groups, rank) for rank, r in enumerate(reads)])
    return assign_transfers(reads, groups, files, *args, **kwargs)


def test_read_once_assignment_reads_every_shared_range_once():
    from ckpt_plugins._src.read_once import ReadRequest as R
    rows = lambda a, n: (((a, 0), (n, 4)),)  # the regions a rank wants from a stored (25, 4) box
    reqs = [[R("f", 0, 0, 100, rows(0, 25)), R("f", 200, 0, 50, rows(0, 12))], [R("f", 0, 0, 60, rows(0, 15))],
            [R("f", 0, 40, 100, rows(10, 15))], [R("g", 0, 0, 8, rows(0, 2))]]
    out = assign(reqs)
    assert set(out.transfers) == {("f", 0)} and out.shared == 1  # items one rank needs stay with that rank
    t = out.transfers[("f", 0)]
    assert (t.start, t.end, t.needers) == (0, 100, (0, 1, 2)) and t.reader in (1, 2)  # rank 0 reads more already
    assert t.wants == (rows(0, 25), rows(0, 15), rows(10, 15))  # what the reader sends each needer
    assert assign(reqs, rank=3).transfers == {} and assign(reqs, rank=3).shared == 1
    assert assign(reqs, rank=1).transfers == out.transfers


def test_disjoint_ranges_of_one_stored_item_are_read_by_their_needers():
    """Row shards of one stored box (a foreign checkpoint's whole tensor): each rank reads its own
    rows, nothing is sent; an overlap makes the item shared again."""
    from ckpt_plugins._src.read_once import ReadRequest as R
    rows = lambda a, n: (((a, 0), (n, 4)),)  # noqa: E731
    apart = [[R("f", 0, 0, 48, rows(0, 3))], [R("f", 0, 48, 96, rows(3, 3))]]
    assert assign(apart).transfers == {} and assign(apart).shared == 0
    overlap = [[R("f", 0, 0, 64, rows(0, 4))], [R("f", 0, 48, 96, rows(3, 3))]]
    assert assign(overlap).shared == 1
    assert assign(apart, readers=lambda f: [0]).shared == 1  # rank 1 cannot read f: rank 0 sends


def test_read_once_assignment_by_runs_is_the_assignment_by_ranks():
    """Replicas request the same weights and each its own optimizer shard: handled by runs
    (`runs_of`), the assignment is the one made rank by rank."""
    from ckpt_plugins._src.runs import runs_of
    from ckpt_plugins._src.read_once import ReadRequest as R
    rows = lambda a, n: (((a, 0), (n, 4)),)  # noqa: E731
    weights = [R("w", 64 * i, 0, 64, rows(0, 4)) for i in range(3)]
    reqs = [weights + [R("o", 96 * r, 0, 32, rows(r, 1)), R("o", 96 * ((r + 1) % 4), 32, 64, rows(r, 1))]
            for r in range(4)]
    keys = ["model/w"] * 3 + ["optim/o"] * 2
    runs = [runs_of(keys, r) for r in reqs]
    assert len({r[0] for r in runs}) == 1 and len({r[1] for r in runs}) == 4
    by_runs, by_ranks = assign(reqs, runs), assign(reqs)
    from ckpt_plugins._src.read_once import RankReads, reads_share
    from ckpt_plugins._src.runs import run_groups
    groups, files = run_groups(runs), {"o": 0, "w": 1}
    sent = [reads_share(RankReads.of(q, files), groups, r) for r, q in enumerate(reqs)]
    assert [len(s) for s in sent] == [2, 3, 3, 3]  # the weights' requests come from the replicas, a third each
    assert [sent[r].request(i, list(files)) for r in range(4) for i in range(len(sent[r]))] == \
        reqs[0][3:] + [q for r in range(1, 4) for q in [reqs[r][r - 1]] + reqs[r][3:]]
    assert by_runs == by_ranks and by_runs.shared == 3  # each optimizer item's halves: read by their needers
    for rank in range(4):
        assert assign(reqs, runs, rank).transfers == {
            k: t for k, t in by_ranks.transfers.items() if rank in t.needers}


def test_an_item_several_runs_need_lists_its_needers_run_by_run():
    """Holders send their runs' requests in shares, so an item two runs need can arrive from the
    later run first: its needers, and the regions each wants, still go run by run in the order
    the runs were first met."""
    from ckpt_plugins._src.runs import runs_of
    from ckpt_plugins._src.read_once import ReadRequest as R
    rows = lambda a, n: (((a, 0), (n, 4)),)  # noqa: E731
    x, y, half = R("f", 0, 0, 64, rows(0, 4)), R("f", 64, 0, 64, rows(0, 4)), R("f", 64, 0, 32, rows(0, 2))
    reqs = [[x, y], [half, R("g", 0, 0, 8, rows(0, 2))], [], [x, y]]  # ranks 0 and 3 alike: each sends one
    runs = [runs_of(["model/w"] * len(r), r) for r in reqs]
    t = assign(reqs, runs).transfers[("f", 64)]  # rank 3's share of the first run comes after rank 1's run
    assert t.needers == (0, 3, 1) and t.wants == (rows(0, 4), rows(0, 4), rows(0, 2))


def test_read_once_assignment_of_random_requests_keeps_its_rules():
    """Random requests of 24 ranks (replicas' alike runs, row shards, overlapping ranges, files
    some ranks cannot read), checked against the rules rather than against itself: an item is
    shared unless each needer reads its own disjoint range of it and can read the file; a shared
    item's reader is a needer that can read it (else a rank that can), reads the union of the
    ranges, and sends each needer its regions; tags run largest first, then by item; runs give
    the assignment made rank by rank; a rank sees the transfers it reads or needs."""
    import random
    from ckpt_plugins._src.runs import runs_of
    from ckpt_plugins._src.read_once import ReadRequest as R
    rnd = random.Random(7)
    items = [(f"data/r{rnd.randrange(6)}-0.bin", 4096 * i) for i in range(60)]
    weights = [R(f, o, 0, 4096, (((i, 0), (1, 8)),)) for i, (f, o) in enumerate(items[:12])]
    reqs, keys = [], []
    for r in range(24):
        own = []
        for f, o in rnd.sample(items[12:], 6):
            a = rnd.randrange(0, 4096, 512)
            own.append(R(f, o, a, rnd.randrange(a + 512, 4097, 512), (((r, o // 4096), (1, 1)),)))
        reqs.append((weights if r % 4 else weights[:6]) + own)
        keys.append(["model/w"] * (12 if r % 4 else 6) + ["optim/o"] * len(own))
    cannot = {"data/r5-0.bin": (3, 4)}
    readers = lambda f: cannot.get(f)  # noqa: E731
    out = assign(reqs, readers=readers)
    needs = {}
    for r, rs in enumerate(reqs):
        for q in rs:
            needs.setdefault(q.item, []).append((r, q))
    for item, users in needs.items():
        can = cannot.get(item.file)
        spans = sorted((q.start, q.end) for _, q in users)
        apart = (all(can is None or r in can for r, _ in users)
                 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])))
        assert (item not in out.transfers) == apart, item
        if not apart:
            t = out.transfers[item]
            assert t.needers == tuple(r for r, _ in users) and t.wants == tuple(q.regions for _, q in users)
            assert (t.start, t.end) == (min(a for a, _ in spans), max(b for _, b in spans))
            able = [r for r in t.needers if can is None or r in can]
            assert t.reader in (able or can)
    assert out.shared == len(out.transfers) > 12
    by_tag = sorted(out.transfers.items(), key=lambda kv: kv[1].tag)
    assert [t.tag for _, t in by_tag] == list(range(out.shared))
    assert [(t.start - t.end, item) for item, t in by_tag] == sorted((t.start - t.end, item) for item, t in by_tag)
    runs = [runs_of(k, q) for k, q in zip(keys, reqs)]  # needers come by run then: the same, reordered
    same = lambda ts: {i: (t.reader, sorted(zip(t.needers, t.wants)), t.start, t.end, t.tag)  # noqa: E731
                       for i, t in ts.items()}
    assert len({r[0] for r in runs}) == 2 and same(assign(reqs, runs, readers=readers).transfers) == same(out.transfers)
    for rank in (0, 3, 23):
        assert same(assign(reqs, runs, rank, readers=readers).transfers) == same(
            {i: t for i, t in out.transfers.items() if rank in t.needers or rank == t.reader})


def test_a_rank_deals_only_the_items_linked_to_those_it_reads_or_needs():
    """Picks change each other through the loads of ranks their needer sets share, so a rank
    deals the chain of items linked to its own (here X -> Y -> Z: rank 0's own read makes rank 1
    read X, then rank 2 Y, then rank 3 Z) and no other (W): its transfers are the global ones."""
    import numpy as np
    from ckpt_plugins._src.read_once import ReadRequest as R, _linked
    whole = lambda item, n: R("f", item, 0, n, (((0,), (n,)),))  # noqa: E731
    x, y, z, w = whole(1000, 100), whole(2000, 50), whole(3000, 10), whole(4000, 20)
    reqs = [[whole(0, 1000), x], [x, y], [y, z], [z], [w], [w]]
    every = assign(reqs).transfers
    assert [every[("f", i)].reader for i in (1000, 2000, 3000)] == [1, 2, 3]
    for rank in range(6):
        assert assign(reqs, rank=rank).transfers == {
            k: t for k, t in every.items() if rank in t.needers or rank == t.reader}
    from ckpt_plugins._src.read_once import _Groups, _NeederSets
    from ckpt_plugins._src.runs import run_groups
    # 8 ranks, each its own group (numbers 0-7); sets of several groups numbered after them
    sets = _NeederSets(_Groups.of(run_groups(None, [1] * 8)), {8: (0, 1), 9: (1, 2), 10: (2, 3), 11: (4, 5)})
    assert sets.holding(1) == [1, 8, 9] and sets[9] == (1, 2)
    items = np.array([8, 9, 10, 11, 6])  # X, Y, Z, W, and one rank 6 needs alone
    linked = lambda rank, wanted: _linked(items, sets, rank, np.array(wanted)).tolist()  # noqa: E731
    assert linked(3, [False, False, True, False, False]) == [True, True, True, False, False]
    assert linked(4, [False] * 5) == [False, False, False, True, False]
    assert linked(6, [False] * 5) == [False, False, False, False, True]
    assert linked(7, [False] * 5) == [False] * 5  # in no set, needing nothing
    assert linked(7, [False, True, False, False, False]) == [True, True, True, False, False]  # needing Y only


def test_read_regions_are_the_payload_layout_and_contiguous_ones_need_no_packing():
    from ckpt_plugins._src.engine.read import needs_packing
    from ckpt_plugins._src.read_once import read_regions
    stored = planned([[spec("w", (4, 6), (0, 0), (4, 6))]]).metadata
    cols, (read,) = spec("w", (4, 6), (0, 2), (4, 2)), plan_load(stored, [spec("w", (4, 6), (1, 0), (2, 6))]).reads
    assert read_regions(read) == (((1, 0), (2, 6)),)
    (twice,) = plan_load(stored, [cols, cols]).reads  # two targets of one region: sent once
    assert len(twice.copies) == 2 and read_regions(twice) == (((0, 2), (4, 2)),)
    assert not needs_packing((4, 6), read_regions(read))  # whole rows: a run of the stored bytes
    assert not needs_packing((4, 6), (((2, 3), (1, 2)),))  # part of one row
    assert needs_packing((4, 6), read_regions(twice))  # columns: strided
    assert needs_packing((4, 6), (((0, 0), (1, 6)), ((1, 0), (1, 6))))  # two regions
    assert not needs_packing((2, 3, 4), (((1, 0, 0), (1, 3, 4)),)) and needs_packing((2, 3, 4), (((0, 1, 0), (2, 1, 4)),))


def test_load_source_of_the_wanted_dtype_is_preferred_and_casts_need_consent():
    stored = planned([[spec("model/w", (4, 2), dtype="bfloat16"), spec("optim/w/master", (4, 2))]]).metadata
    weights = spec("model/w", (4, 2), dtype="float16")
    with pytest.raises(LoadMismatchError, match=r"model/w: the model wants float16, .*model/w is bfloat16"):
        plan_load(stored, [weights])
    from dataclasses import replace
    weights = replace(weights, dtype="float32")  # an fp32 model
    assert plan_load(stored, [weights]).reads[0].key == "model/w"  # bf16 -> fp32 loses nothing: allowed
    (read,) = plan_load(stored, [replace(weights, sources=("optim/w/master",))]).reads
    assert read.key == "optim/w/master"  # the fp32 master fills an fp32 model exactly
    (read,) = plan_load(stored, [replace(weights, dtype="bfloat16", sources=("optim/w/master",))]).reads
    assert read.key == "model/w"  # a bf16 model takes the bf16 weights
    (read,) = plan_load(stored, [replace(weights, dtype="float16", sources=("optim/w/master",), cast=True)]).reads
    assert read.key == "model/w"  # no copy of the wanted dtype: the first candidate, converted
    missing = plan_load(stored, [replace(weights, key="model/v", sources=("optim/v/master",))])
    assert missing.missing == ["model/v"] and not missing.reads


def test_weights_vouched_for_as_their_masters_cast_are_stored_as_the_masters():
    """With every rank's word (`casts`), a 16-bit weight whose fp32 master covers it is a tensor
    entry without boxes; the masters' boxes are read for it, and never widened as if they were it."""
    from dataclasses import replace
    rows = [[spec("model/w", (4, 2), dtype="bfloat16"), spec("optim/w/master", (4, 2), (2 * r, 0), (2, 2)),
             spec("model/f", (3,), dtype="bfloat16"), spec("model/h", (2,), dtype="float16"),
             spec("optim/h/master", (2,), (0,), (1,))] for r in range(2)]
    plain, cast = planned(rows), planned(rows, casts=True)
    assert plain.metadata.casts == {} and len(plain.metadata.tensors["model/w"].boxes) == 1
    # f has no master, h's master covers half of it: both stay stored
    assert cast.metadata.casts == {"model/w": "optim/w/master"}
    assert cast.metadata.tensors["model/w"].boxes == [] and cast.metadata.tensors["model/w"].dtype == "bfloat16"
    assert sum(cast.rank_bytes) == sum(plain.rank_bytes) - 4 * 2 * 2
    assert all(w.index != 0 for ws in cast.writes for w in ws)  # no rank writes its spec 0, model/w
    weights = spec("model/w", (4, 2), dtype="bfloat16")
    (master, *rest) = plan_load(cast.metadata, [weights, spec("optim/w/master", (4, 2))]).reads
    assert master.key == "optim/w/master" and len(master.copies) == 2  # one read fills the weight and the master
    with pytest.raises(LoadMismatchError, match=r"model/w: the model wants float32, .*model/w is bfloat16"):
        plan_load(cast.metadata, [replace(weights, dtype="float32")])  # widening the master is not the weight
    assert plan_load(cast.metadata, [replace(weights, dtype="float16", cast=True)]).reads[0].key == "optim/w/master"


def test_a_ranks_masters_are_checked_bit_for_bit_against_the_weights_it_holds(monkeypatch):
    """The rank's word for `casts`: every fp32 master piece it holds, cast, equals the weight it
    holds there in every bit (NaN payloads too), across chunk ends and unaligned pieces; a master
    whose weight it does not hold cannot be vouched for; a master of an fp32 weight is no cast."""
    import torch
    from ckpt_plugins._src import casts
    from ckpt_plugins._src.fragment import box_fragment
    monkeypatch.setattr(casts, "CHUNK", 5)
    master = torch.randn(7, 3)
    master[2, 1] = torch.tensor(0x7FC00001, dtype=torch.int32).view(torch.float32)  # a NaN with a payload
    weight = master.to(torch.bfloat16)

    def frags(weight, rows=(1, 6)):  # this rank's master rows: a flat range of 15 elements
        piece = master[rows[0]:rows[1]]
        return [box_fragment("model/w", (7, 3), (0, 0), weight), box_fragment("optim/w/master", (7, 3), (rows[0], 0), piece)]
    assert casts.masters_cast_exactly(frags(weight)) and casts.masters_cast_exactly(frags(weight, (0, 7)))
    wide = torch.zeros(7, 5, dtype=torch.bfloat16)
    wide[:, 1:4] = weight
    assert casts.masters_cast_exactly(frags(wide[:, 1:4]))  # a strided weight (part of a fused tensor)
    wide[5, 2] += 1
    assert not casts.masters_cast_exactly(frags(wide[:, 1:4]))
    quiet = weight.clone()
    quiet.view(torch.int16)[2, 1] ^= 1  # NaN still, another payload
    assert not casts.masters_cast_exactly(frags(quiet))
    assert casts.masters_cast_exactly(frags(quiet, (3, 7)))  # the changed element is not this rank's
    assert not casts.masters_cast_exactly(frags(weight)[1:])  # a master without its weight
    assert casts.masters_cast_exactly(frags(master.clone()))  # fp32 weights: the masters are no cast


def test_planning_pauses_the_garbage_collector_and_gives_it_back():
    import gc
    import threading

    from ckpt_plugins._src.gcpause import gc_paused
    seen, entered, leave = [], threading.Event(), threading.Event()

    @gc_paused
    def work(wait=False):
        seen.append(gc.isenabled())
        if wait:
            entered.set()
            leave.wait(10)

    assert gc.isenabled()
    slow = threading.Thread(target=work, args=(True,))
    slow.start()
    entered.wait(10)
    work()  # a second planner while the first runs: the first's pause holds
    assert gc.isenabled() is False
    leave.set()
    slow.join()
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        work()
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_staging_windows_hold_a_save_whole_when_it_fits_and_stream_it_through_two_halves_otherwise():
    from ckpt_plugins._src.engine.window import MIN_SPAN, plan_windows
    mib = 1 << 20
    sizes = {"d/r0-0.bin": 5 * mib + 3, "d/r0-1.bin": 2 * mib, "d/r0-objects.bin": 100, "d/r0-2.bin": 0}
    whole = plan_windows(sizes, 8 * mib)
    assert whole.spans is None and len(whole.windows) == 1
    assert whole.windows[0].ranges == {"d/r0-0.bin": (0, 5 * mib + 3), "d/r0-1.bin": (0, 2 * mib),
                                       "d/r0-objects.bin": (0, 100)}
    assert whole.windows[0].at == {"d/r0-0.bin": 0, "d/r0-1.bin": 5 * mib + 4096,
                                   "d/r0-2.bin": 7 * mib + 4096, "d/r0-objects.bin": 7 * mib + 4096}
    room = 3 * mib
    streamed = plan_windows(sizes, room)
    # each file's span its share of a half: every window holds the same part of each big file
    assert len(streamed.windows) == 5 and streamed.spans["d/r0-objects.bin"] == MIN_SPAN
    assert abs(streamed.spans["d/r0-0.bin"] / streamed.spans["d/r0-1.bin"] - 2.5) < 0.01
    for name, size in sizes.items():  # every byte of a file in one window, in order
        ranges = [w.ranges[name] for w in streamed.windows if name in w.ranges]
        span = streamed.spans[name]
        assert [r[0] for r in ranges] == list(range(0, size, span)) and (ranges[-1][1] if ranges else 0) == size
        assert all(streamed.index(name, lo) == k and streamed.index(name, hi - 1) == k for k, (lo, hi) in enumerate(ranges))
    for k, window in enumerate(streamed.windows):  # within the room; a window's half is not the next one's
        spans = sorted((window.place(n, lo), window.place(n, hi)) for n, (lo, hi) in window.ranges.items())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= room
        assert all((start < room // 2) == (k % 2 == 0) for start, _ in spans)
    with pytest.raises(MemoryError, match=f"too small to stream this rank's 4 data files through: give it at least {8 * MIN_SPAN} bytes"):
        plan_windows(sizes, 8 * MIN_SPAN - 1)
    assert len(plan_windows(sizes, 8 * MIN_SPAN).windows) > 1


def test_checksums_fed_in_any_pieces_are_those_of_the_whole_item():
    import random
    from ckpt_plugins._src.format import ChunkSums, chunk_checksums
    data = random.Random(0).randbytes(3 * 1024 + 17)
    for cuts in ([], [1], [1024], [100, 1500, 2048, 3000], list(range(7, len(data), 333))):
        sums = ChunkSums(chunk=1024)
        for lo, hi in zip([0] + cuts, cuts + [len(data)]):
            sums.feed(data[lo:hi])
        assert sums.result() == chunk_checksums(data, 1024), cuts
    assert ChunkSums().result() == chunk_checksums(b"")


def test_a_tensor_of_many_boxes_is_searched_by_array_with_the_plan_of_a_box_by_box_scan(monkeypatch):
    """A tensor stored in more than `MANY_BOXES` boxes has the boxes meeting a wanted one found
    with arrays (from the decoded table's columns, or from the written boxes): the plan is the
    one a scan of every box gives, for random grids and flat ranges and random wanted boxes."""
    from ckpt_plugins._src import plan as planning
    from ckpt_plugins._src.metadata_codec import decode_metadata, encode_metadata
    rng = np.random.default_rng(2)

    def cuts(n, parts):
        return [0] + sorted(rng.choice(np.arange(1, n), parts - 1, replace=False).tolist()) + [n]

    def wanted(key, shape):
        lo = [int(rng.integers(0, n)) for n in shape]
        return spec(key, shape, tuple(lo), tuple(int(rng.integers(1, n - o + 1)) for o, n in zip(lo, shape)))

    for _ in range(6):
        grid, flat = (int(rng.integers(40, 90)), int(rng.integers(5, 30))), (int(rng.integers(200, 400)),)
        rows, cols, ranges = cuts(grid[0], 7), cuts(grid[1], 4), cuts(flat[0], 30)
        ranks = [[spec("model/g", grid, (r0, c0), (r1 - r0, c1 - c0))]
                 for r0, r1 in zip(rows, rows[1:]) for c0, c1 in zip(cols, cols[1:])]
        ranks += [[spec("optim/flat", flat, (a,), (b - a,))] for a, b in zip(ranges, ranges[1:])]
        written = planned(ranks[::-1] if rng.random() < 0.5 else ranks).metadata
        for meta in written.tensors.values():
            for box in meta.boxes:
                box.crc32c = [0]
        assert min(len(t.boxes) for t in written.tensors.values()) > planning.MANY_BOXES
        specs = [wanted("model/g", grid) for _ in range(5)] + [wanted("optim/flat", flat) for _ in range(5)]
        for metadata in (written, decode_metadata(encode_metadata(written))):
            searched = plan_load(metadata, specs)
            with monkeypatch.context() as m:
                m.setattr(planning, "MANY_BOXES", 10**9)
                scanned = plan_load(metadata, specs)
            assert searched == scanned and len(searched.reads) > len(specs)


def test_stored_keys_and_files_are_numbered_alike_from_a_decoded_table_and_a_written_dict():
    """A load numbers the stored keys and the files it reads on the decoded tensor table's own
    indexes (`StoredKeys`, `file_table`): the numbers are those of the metadata as written
    (tensors in order, then objects and aliases not among them), and a descriptive entry is
    never reported unused."""
    from dataclasses import replace
    from ckpt_plugins._src.format import ObjectMeta
    from ckpt_plugins._src.loading import StoredKeys, file_table
    from ckpt_plugins._src.metadata_codec import decode_metadata, encode_metadata
    written = planned([[spec("model/b", (2,)), spec("model/a", (3,)), spec("optim/a/exp_avg", (3,))]]).metadata
    for meta in written.tensors.values():
        for box in meta.boxes:
            box.crc32c = [0]
    written = replace(written, objects={"extra/step": [ObjectMeta(file="data/r0-0.bin", offset=0, nbytes=1, crc32c=[0])],
                                        "model/a": [ObjectMeta(file="data/r0-0.bin", offset=0, nbytes=1, crc32c=[0])]},
                      aliases={"model/tied": "model/a"})
    decoded = decode_metadata(encode_metadata(written))
    assert type(decoded.tensors) is not dict
    names = list(written.tensors) + ["extra/step", "model/tied"]
    assert sorted(names[:3]) == ["model/a", "model/b", "optim/a/exp_avg"]
    a = names.index("model/a")
    for keys in (StoredKeys.of(decoded), StoredKeys.of(written)):
        assert keys.names == names
        assert keys.of_keys({"model/tied", "model/a", "nope"}).tolist() == [a, 4]
        assert keys.unused(np.array([a, 4, a])) == sorted(set(names) - {"model/a", "model/tied"})
    files, numbers = file_table(decoded)  # the files of the boxes built so far, numbered as in the table
    assert files == list(written.files) and numbers == {}
    box = decoded.tensors["model/a"].boxes[0]
    assert numbers == {box.file: files.index(box.file)}
    assert file_table(written) == (files, {f: i for i, f in enumerate(files)})
    keys = StoredKeys.of(replace(written, objects={}))
    keys.descriptive = {"model/b"}
    assert keys.unused(keys.of_keys({"optim/a/exp_avg"})) == ["model/a", "model/tied"]


def test_lexsorted_orders_rows_as_lexsort_does_packed_or_not():
    """One stable sort of the keys packed into an int64 gives `np.lexsort`'s order, ties kept in
    place, negative keys included; keys whose bits do not fit in 63 are lexsorted as they are. And
    `firsts` finds each value's first place in a sorted column, as a binary search does."""
    from ckpt_plugins._src.sorting import firsts, lexsorted
    rng = np.random.default_rng(0)
    small = [rng.integers(-3, 4, 500), rng.integers(0, 2, 500).astype(bool), rng.integers(0, 5, 500)]
    wide = [rng.integers(-2**40, 2**40, 500), rng.integers(0, 3, 500), rng.integers(0, 2**30, 500)]
    for keys in small, wide, small[:1], [np.sort(small[2])]:
        assert (lexsorted(keys) == np.lexsort(keys)).all()
    assert lexsorted([np.zeros(0, dtype=np.int64)] * 2).tolist() == []
    runs = np.sort(small[2])
    assert (firsts(runs) == np.searchsorted(runs, runs)).all() and firsts(runs[:0]).tolist() == []


def test_random_layouts_write_each_box_once_from_a_rank_holding_it():
    """Replicated, sharded and big split tensors, held in runs alike and in different orders (so
    one box is held by several run groups), a box one rank holds twice: every tensor is tiled by
    its stored boxes, each written by a rank whose spec at the write's index holds it, and
    planning by runs gives the plan planned spec by spec."""
    rng = np.random.default_rng(1)
    for _ in range(40):
        world = int(rng.integers(1, 6))
        tensors = [(f"model/t{i}", (int(rng.choice([1, 8, 4096, 8192])), int(rng.choice([3, 2048, 4096]))))
                   for i in range(int(rng.integers(1, 5)))] + [("model/b", (int(rng.integers(1, 9)),))]
        parts = [int(rng.choice([1, 1, min(2, world), world])) for _ in tensors]  # replicated, or sharded in rows
        twice = rng.random() < 0.3  # the last rank holds its first spec twice
        ranks = []
        for r in range(world):
            specs = []
            for (key, shape), n in zip(tensors, parts):
                rows = -(-shape[0] // n)
                if r % n * rows < shape[0]:
                    lengths = (min(rows, shape[0] - r % n * rows),) + shape[1:]
                    specs.append(spec(key, shape, (r % n * rows,) + (0,) * (len(shape) - 1), lengths))
            specs = specs[::-1] if rng.random() < 0.3 else specs
            specs += [spec(f"optim/r{r}", (int(rng.integers(1, 50)),))] + specs[:1] * (twice and r == world - 1)
            ranks.append(specs)
        files = int(rng.integers(1, 3))
        plan = planned(ranks, files, digests=[spec_runs(r) for r in ranks])
        if not twice:  # a box one rank holds twice: either of its places may be the one written
            by_specs = planned(ranks, files)
            assert plan.metadata == by_specs.metadata and plan.writes == by_specs.writes
        key_of = {(b.file, b.offset): k for k, t in plan.metadata.tensors.items() for b in t.boxes}
        for r, writes in enumerate(plan.writes):
            for w in writes:
                held = ranks[r][w.index]
                assert key_of[w.file, w.offset] == held.key
                assert all(o <= a and a + n <= o + m for o, m, a, n in zip(held.offsets, held.lengths, *w.box))
        for key, t in plan.metadata.tensors.items():
            boxes = [(b.offsets, b.lengths) for b in t.boxes]
            assert sum(int(np.prod(n)) for _, n in boxes) == int(np.prod(t.shape)), key
            assert all(any(a + n <= c or c + m <= a for a, n, c, m in zip(*x, *y))
                       for i, x in enumerate(boxes) for y in boxes[:i]), key


def test_distinct_numbers_values_as_np_unique_does():
    """`distinct` is `np.unique`'s inverse and first index, for int64 (negative included) and
    uint64 columns, with values whose high bits tie (sorted by their row numbers first) among
    them; `first_met` renumbers them in the order the rows meet them."""
    from ckpt_plugins._src.sorting import distinct, first_met
    rng = np.random.default_rng(2)
    hashes = rng.integers(-2**63, 2**63 - 1, 300, dtype=np.int64)[rng.integers(0, 300, 3000)]
    tied = (rng.integers(0, 4, 3000).astype(np.uint64) << np.uint64(60)) | rng.integers(0, 6, 3000).astype(np.uint64)
    for values in hashes, tied, tied.view(np.int64), hashes[:1], hashes[:0]:
        number, first = distinct(values)
        _, index, inverse = np.unique(values, return_index=True, return_inverse=True)
        assert (number == inverse.reshape(-1)).all() and (first == index).all()
        met, firsts_met = first_met(number, first)
        assert (firsts_met == np.sort(index)).all() and (values[firsts_met][met] == values).all()
        assert (met[firsts_met] == np.arange(len(index))).all()
