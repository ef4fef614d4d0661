"""Pushing each rank's memory-step files to its replica rank on another host, over the
checkpoint's background group, in pieces through two reusable buffers on each side: a piece is
read (or written) while the previous one is on the wire.

Pieces, not the files' own mappings: sending from and receiving into mapped shared-memory files
faulted in every page on the way (`bench/memory_tier.py` times a memory save's background part).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from .. import own_threads
from ..coordinator import Coordinator
from .hostdir import PIECE, HostDir, Landing, pieces
from .layout import Hosts


def replicate(coord: Coordinator, hosts: Hosts, files: Sequence[Dict[str, int]], host: HostDir,
              step: int) -> None:
    """Send this rank's files (`files[rank]`: name -> size, every rank's) to its replica rank and
    receive those of the ranks it keeps replicas for. Every promised piece goes out even when this
    rank's part failed (zeros, then), so no peer waits for one that never comes; this rank's
    failure is raised only then, for the caller's agreement. A peer that is gone breaks the
    transfer at once (PeerLost)."""
    rank, failed, broken = coord.rank, [], []
    target = hosts.replica_of(rank)
    sender = None
    if target is not None and files[rank]:
        sender = own_threads.thread(_send, "ckpt-replicate", coord, files[rank], host, step, target, failed, broken)
        sender.start()
    landings: List[Landing] = []
    try:
        for source in hosts.replicas_for(rank):
            _receive(coord, files[source], host, step, source, landings, failed, broken)
    finally:
        if sender is not None:
            sender.join()
        try:
            if broken:
                lost = coord.lost(broken[0])
                raise lost if lost is not None else broken[0]
            for landing in landings if not failed else ():
                try:
                    landing.keep()
                except OSError as exc:  # this rank's failure, raised once every landing is closed
                    failed.append(exc)
                    break
        finally:
            for landing in landings:  # those not kept: their partial files go
                landing.close()
    if failed:
        raise failed[0]


def _buffers() -> List[torch.Tensor]:
    return [torch.empty(PIECE, dtype=torch.uint8) for _ in range(2)]


def _send(coord, files, host: HostDir, step: int, target: int, failed: list, broken: list) -> None:
    buffers, posted = _buffers(), [None, None]
    try:
        for tag, (name, offset, n) in enumerate(pieces(files)):
            slot = tag % 2
            if posted[slot] is not None:
                posted[slot].wait()  # this buffer's previous piece has left
            piece = buffers[slot][:n]
            if not failed:
                try:
                    host.read_piece(step, name, offset, piece)
                except Exception as exc:
                    failed.append(exc)
            if failed:
                piece.zero_()  # what was promised, so the peer is not left waiting
            posted[slot] = coord.isend(piece, target, tag)
        for work in posted:
            if work is not None:
                work.wait()
    except BaseException as exc:  # the peer is gone: the caller raises it
        broken.append(exc)


def _receive(coord, files, host: HostDir, step: int, source: int, landings: List[Landing], failed: list,
             broken: list) -> None:
    buffers, posted = _buffers(), [None, None]
    ready: Dict[str, Optional[Landing]] = {}

    def land(slot: int) -> None:
        work, name, offset, n = posted[slot]
        posted[slot] = None
        work.wait()
        if ready.get(name) is not None and not failed:
            try:
                ready[name].write(offset, buffers[slot][:n])
            except Exception as exc:
                failed.append(exc)

    try:
        for name, size in sorted(files.items()):  # every file, empty ones too
            try:
                ready[name] = host.land(step, name, size)
                landings.append(ready[name])
            except Exception as exc:
                failed.append(exc)
                ready[name] = None
        for tag, (name, offset, n) in enumerate(pieces(files)):
            slot = tag % 2
            if posted[slot] is not None:
                land(slot)
            posted[slot] = (coord.irecv(buffers[slot][:n], source, tag), name, offset, n)
        for slot in range(2):
            if posted[slot] is not None:
                land(slot)
    except BaseException as exc:
        broken.append(exc)
