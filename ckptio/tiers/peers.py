"""A tiered load's reads from other nodes: the bytes a rank's load needs of files its node does not hold
are fetched from a node that holds them (its own copy, or a partner's copy: ``replication.py``), over
the load's process group, before the load reads. Only the stored items the rank reads travel (a
resharded restart does not pull whole files), into memory: a replacement node restarts without writing
anything first. Every block is checked as the load reads it, against the checkpoint's records, as from
any tier (the pieces carry no CRC32C of their own: that would check the same bytes twice more); a copy
that fails is read from the durable tier instead (``nearest.py``).

Which items: those a rank's plan reads from the checkpoint's data files its node lacks, each sent by a
rank of another node that holds it, in a copy of its data file or as a replica in another rank's file
(spread over the ranks that offer it); an item no node holds is read from the durable tier. A replacement
node holds its ranks' copies again after their next save.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any, Iterable

import torch
import torch.distributed as dist

from ckptio.format.records import Manifest
from ckptio.loading.read_once import DIRECT
from ckptio.storage import FsspecStore, ReadRequest
from ckptio.tiers.held_index import LocalCopies
from ckptio.tiers.nodes import this_node
from ckptio.tiers.replication import move_files, pieces_of

#: Bytes sent as one message of a fetch: received in place, sent from the mapped file where a piece is
#: one run of a file's bytes (larger messages than a copy's: 64 MiB moved in 0.07 s instead of 0.10 s
#: as 8 MiB pieces, two streams on 2 cores).
FETCH_PIECE_BYTES = 32 << 20


class FetchedFile:
    """Byte ranges of one data file, received from another node; what is not held reads as zeros (the gap
    bytes a merged read skips; a block missing would fail its CRC32C, never pass)."""

    def __init__(self, size: int, ranges: list[tuple[int, torch.Tensor]]):
        self.size = size
        self.ranges = sorted(ranges, key=lambda r: r[0])
        self.starts = [offset for offset, _ in self.ranges]

    def read_into(self, request: ReadRequest) -> int:
        """Fill ``request``'s buffers; the bytes it covers of the file."""
        at = request.offset
        for buffer in request.buffers:
            out = buffer.cast("B")
            filled = 0  # of ``out``, in order
            for offset, data in self._overlapping(at, at + len(out)):
                lo, hi = max(at, offset), min(at + len(out), offset + len(data))
                out[filled : lo - at] = bytes(max(0, lo - at - filled))
                out[lo - at : hi - at] = memoryview(data.numpy())[lo - offset : hi - offset]
                filled = hi - at
            out[filled:] = bytes(len(out) - filled)
            at += len(out)
        return min(at, self.size) - request.offset

    def _overlapping(self, start: int, end: int) -> Iterable[tuple[int, torch.Tensor]]:
        first = max(0, bisect.bisect_right(self.starts, start) - 1)
        for offset, data in self.ranges[first:]:
            if offset >= end:
                break
            if offset + len(data) > start:
                yield offset, data


def fetch_from_peers(
    group: Any, local: FsspecStore, copies: LocalCopies, manifest: Manifest, needed: dict[str, list]
) -> dict[str, FetchedFile]:
    """Fetch ``needed`` (file -> ``(offset, length)`` of each stored item this rank reads from a data file
    its node lacks) from other nodes; every rank of ``group`` calls it, and serves what others need of its
    node's copies: a data file it holds whole, or an item it holds as a replica in another file. The files
    received, by name (none without a process group)."""
    if group is DIRECT or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {}
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    needs: list = [None] * world
    dist.all_gather_object(needs, (this_node(), needed), group=group)
    if not any(wanted for _, wanted in needs):  # every node holds what its ranks read (the usual restart)
        return {}
    where = _served_here(copies, manifest)
    mine = {
        receiver: [(name, offset) for name, spans in wanted.items() for offset, _ in spans if (name, offset) in where]
        for receiver, (node, wanted) in enumerate(needs)
        if node != needs[rank][0]
    }
    offers: list = [None] * world
    dist.all_gather_object(offers, mine, group=group)
    outgoing: dict[int, list[tuple[str, int, int]]] = {}
    receiving: dict[int, list[tuple[str, int, int]]] = {}
    for receiver, server, name, offset, length in _plan(needs, offers):
        if server == rank:
            outgoing.setdefault(receiver, []).append((*where[(name, offset)], length))
        if receiver == rank:
            receiving.setdefault(server, []).append((name, offset, length))
    incoming = {server: _Stream(segments) for server, segments in receiving.items()}
    # no CRC32C of the pieces: the load checks every block it reads
    move_files(group, local.root, outgoing, incoming, checked=False, piece_bytes=FETCH_PIECE_BYTES)
    fetched: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for stream in incoming.values():
        for name, offset, data in stream.whole():
            fetched.setdefault(name, []).append((offset, data))
    return {name: FetchedFile(manifest.files[name], ranges) for name, ranges in fetched.items()}


def _served_here(copies: LocalCopies, manifest: Manifest) -> dict[tuple[str, int], tuple[str, int]]:
    """``(data file, offset)`` of the checkpoint's stored items this node holds -> ``(fast-tier file,
    offset)`` where it holds them: in a copy of the data file itself, or relocated (a replica)."""
    where = {}
    per_rank = [record for copies_of_key in manifest.per_rank.values() for record in copies_of_key.values()]
    for key, record in itertools.chain(manifest.items.items(), ((None, record) for record in per_rank)):
        if record.inline is not None or not record.file:
            continue
        if record.file in copies.files:
            where[(record.file, record.offset)] = (record.file, record.offset)
        elif key in copies.relocated:
            moved = copies.relocated[key]
            where[(record.file, record.offset)] = (moved.file, moved.offset)
    return where


def needed_items(items: Iterable[Any], local: set[str], data_files: dict[str, int]) -> dict[str, list]:
    """``file -> [(offset, length), ...]`` (in order) of the stored items a load reads from the
    checkpoint's data files ``data_files`` that are not among ``local`` (the node's)."""
    spans: dict[str, set[tuple[int, int]]] = {}
    for item in items:
        if item.inline is None and item.file in data_files and item.file not in local and item.stored_bytes:
            spans.setdefault(item.file, set()).add((item.offset, item.stored_bytes))
    return {name: sorted(pairs) for name, pairs in spans.items()}


def _plan(needs: list, offers: list) -> list[tuple[int, int, str, int, int]]:
    """``(receiving rank, serving rank, file, offset, length)`` of each item fetched: each item a rank
    needs, from one of the ranks of other nodes that offered it (spread over them, in turn)."""
    servers: dict[tuple[int, str, int], list[int]] = {}
    for server, offered in enumerate(offers):
        for receiver, items in offered.items():
            for name, offset in items:
                servers.setdefault((receiver, name, offset), []).append(server)
    plan = []
    for receiver, (_, wanted) in enumerate(needs):
        for name in sorted(wanted):
            for offset, length in wanted[name]:
                ranks = servers.get((receiver, name, offset))
                if ranks:
                    plan.append((receiver, ranks[len(plan) % len(ranks)], name, offset, length))
    return plan


class _Stream:
    """A server's items (``(file, offset, length)``) arriving as one stream of pieces
    (``replication.move_files``), received in place into one buffer; an item in a piece that fails its
    CRC32C is dropped."""

    def __init__(self, segments: list[tuple[str, int, int]]):
        self.segments = segments
        total = sum(length for _, _, length in segments)
        self.count = pieces_of(total, FETCH_PIECE_BYTES)
        self.buffer = torch.empty(total, dtype=torch.uint8)
        self.starts = list(itertools.accumulate((length for _, _, length in segments), initial=0))
        self._filled = 0
        self._broken: list[tuple[int, int]] = []

    @property
    def expecting(self) -> bool:
        return self._filled < len(self.buffer)

    def buffer_for(self, length: int) -> torch.Tensor:
        if self._filled + length > len(self.buffer):
            return torch.empty(length, dtype=torch.uint8)  # a peer out of step: taken, and dropped
        return self.buffer[self._filled : self._filled + length]

    def take(self, data: memoryview, whole: bool) -> None:
        if not whole or self._filled + len(data) > len(self.buffer):
            self._broken.append((self._filled, self._filled + len(data)))
        self._filled += len(data)

    def whole(self) -> list[tuple[str, int, torch.Tensor]]:
        """The items that arrived whole."""
        out = []
        for (name, offset, length), start in zip(self.segments, self.starts, strict=False):
            end = start + length
            if end <= self._filled and not any(lo < end and start < hi for lo, hi in self._broken):
                out.append((name, offset, self.buffer[start:end]))
        return out
