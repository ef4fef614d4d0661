"""The coordinator's collectives on real processes: messages of any length, none, or a failure."""
import numpy as np
import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ckpt_plugins._src import coordinator
from ckpt_plugins._src.coordinator import Coordinator
from ckpt_plugins._src.errors import CheckpointError
from ckpt_plugins._src.packing import Joined, gathered, unframed
from distributed import run_ranks


def test_a_gathered_buffer_holds_every_message_in_place_and_a_bad_frame_is_named():
    blobs = [b"", b"12345678", b"x" * 16]
    buffer = gathered(blobs)
    assert len(buffer) == 3 * 24
    joined = Joined.gathered(buffer, 3, "messages")
    assert joined.buffer is buffer and joined.size.tolist() == [0, 8, 16]
    assert [bytes(buffer[a:a + n]) for a, n in zip(joined.start, joined.size)] == blobs
    buffer[24:32] = (17).to_bytes(8, "little")  # rank 1's frame claims more than it can hold
    with pytest.raises(ValueError, match="rank 1's frame says 17 bytes, in 16"):
        unframed(buffer, 3)
    with pytest.raises(ValueError, match="a gathered buffer of 72 bytes does not hold 4 frames"):
        unframed(buffer, 4)


real_c10d_gather = dist.gather


def _collectives(rank, world):
    coord = Coordinator()
    mine = bytes([rank]) * (5 * rank)  # rank 0 sends nothing
    start, size = unframed(coord.all_gather_bytes(mine), world)
    assert size.tolist() == [0, 5, 10]
    assert coord.all_gather({"rank": rank, "pad": "y" * rank}) == [{"rank": r, "pad": "y" * r} for r in range(world)]
    assert coord.gather(("r", rank)) == ([("r", r) for r in range(world)] if rank == 0 else None)
    assert coord.scatter([np.arange(r * 100) for r in range(world)] if rank == 0 else None).tolist() == list(
        range(rank * 100))
    assert coord.all_flags(rank * 7) == [0, 7, 14]
    assert coord.collectives == 5
    # a broadcast is one collective unless its message outgrows the first (a failure's traceback)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].numel())
        return real(*args, **kwargs)
    real = c10d.broadcast
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(c10d, "broadcast", counted)
        patch.setattr(dist, "broadcast", counted)
        assert coord.broadcast({"committed": True} if rank == 0 else None) == {"committed": True}
        assert len(calls) == 1
        long = [f"{i}" * 1000 for i in range(10)]
        assert coord.broadcast(long if rank == 0 else None) == long
        assert len(calls) == 3

    def request():
        if rank == 1:
            raise ValueError("no plan on this rank")
        return mine

    with pytest.raises(CheckpointError, match="load of x failed: rank 1: ValueError: no plan on this rank. Nothing"):
        coord.agreed_bytes(request, what="load of x", then="Nothing was loaded")

    # a step that runs a collective of its own (ZeRO-3's gather at a load's end) is not started by
    # any rank once one has failed: the others would wait in it for the failed rank
    ran = []

    def data():
        if rank == 2:
            raise ValueError("a checksum mismatch")

    def gather():
        ran.append(coord.all_flags(rank))
    with pytest.raises(CheckpointError, match="load of x failed: rank 2: ValueError: a checksum mismatch"):
        coord.agreed_steps([data, gather], what="load of x")
    assert ran == []
    gathers, real_gather = [], coordinator._all_gather_single
    with pytest.MonkeyPatch.context() as patch:  # all went well: a flag after each step, nothing more
        patch.setattr(coordinator, "_all_gather_single", lambda *a, **k: gathers.append(1) or real_gather(*a, **k))
        coord.agreed_steps([data if rank != 2 else lambda: None, gather], what="load of x")
    assert ran == [[0, 1, 2]] and len(gathers) == 3  # the step's own gather among them

    # a gather of small messages is one collective; one message longer than its head, two
    head = coordinator.head_bytes(world)
    for longest in (head - 8, head - 7):
        gathers.clear()
        sizes = [0, longest, 3]
        blob = bytes([rank + 1]) * sizes[rank]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(coordinator, "_all_gather_single", lambda *a, **k: gathers.append(1) or real_gather(*a, **k))
            patch.setattr(dist, "gather", lambda *a, **k: gathers.append(1) or real_c10d_gather(*a, **k))
            every, to_root = coord.all_gather_bytes(blob), coord.gather_bytes(blob)
        assert len(gathers) == (2 if longest <= head - 8 else 4)
        for buffer in [every] + ([to_root] if rank == 0 else []):
            start, size = unframed(buffer, world)
            assert [bytes(buffer[a:a + n]) for a, n in zip(start, size)] == [bytes([r + 1]) * sizes[r] for r in range(3)]
        assert rank == 0 or to_root is None


def test_collectives_carry_messages_of_any_length_and_a_failure_reaches_every_rank():
    run_ranks(3, _collectives)
