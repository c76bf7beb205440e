"""A tiered load's reads from other nodes: the bytes a rank's load needs of files its node does not hold
are fetched from a node that holds them (its own copy, or a partner's copy: ``replication.py``), over
the load's process group, before the load reads. Only the stored items the rank reads travel (a
resharded restart does not pull whole files), into memory: a replacement node restarts without writing
anything first. An item of at least ``ALONE_BYTES`` travels in messages of its own, received straight into
the tensor it loads into where its stored bytes land there unchanged (raw, read whole); smaller ones travel
together into one buffer (fresh memory costs a page fault per page: receiving 64 MiB into a new buffer took
twice as long as into memory in use). Every block is checked as the load reads it, against the
checkpoint's records, as from any tier (the pieces carry no CRC32C of their own: that would check the same
bytes twice more); a copy that fails is read from the durable tier instead (``nearest.py``).

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
from ckptio.loading.exchange import all_objects, send_and_receive
from ckptio.loading.read_once import DIRECT
from ckptio.loading.shared_reads import Placements, as_tensor, memory_address
from ckptio.storage import FsspecStore, ReadRequest
from ckptio.tiers.held_index import LocalCopies
from ckptio.tiers.nodes import this_node
from ckptio.tiers.replication import Pieces, fixed_pieces

#: Bytes sent as one message of a fetch at most, from the mapped file where a piece is one run of a
#: file's bytes (larger messages than a copy's: 64 MiB moved in 0.07 s instead of 0.10 s as 8 MiB
#: pieces, two streams on 2 cores).
FETCH_PIECE_BYTES = 32 << 20
#: An item at least this large travels in messages of its own (received into its place, if it has one).
ALONE_BYTES = 1 << 20
#: Bytes a rank's fetch sends before it waits for its oldest sends: bounds the pieces it gathers from
#: several runs of a file (small items), the only ones that take memory (the others are sent from the
#: mapped file).
SENDING_BYTES = 256 << 20


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
                if memory_address(out[lo - at : hi - at]) != data.data_ptr() + lo - offset:  # not received in place
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


def gather_needs(group: Any, needed: dict[str, list]) -> list | None:
    """Every rank's node and ``needed`` (file -> ``(offset, length)`` of each stored item it reads from a
    data file its node lacks); every rank of ``group`` calls it. ``None`` on every rank where no rank needs
    anything (the usual restart) or there is no process group: then nothing is fetched."""
    if group is DIRECT or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    needs = all_objects((this_node(), needed), group)
    return needs if any(wanted for _, wanted in needs) else None


def fetch_from_peers(
    group: Any,
    needs: list,
    local: FsspecStore,
    copies: LocalCopies,
    manifest: Manifest,
    places: list[tuple[str, int, memoryview]],
) -> dict[str, FetchedFile]:
    """Fetch what this rank ``needs`` (``gather_needs``) from other nodes, an item lying wholly in one of
    the ``places`` (``(file, offset, memory)``: where stored bytes land unchanged) into it; every rank of
    ``group`` calls it, and serves what others need of its node's copies: a data file it holds whole, or an
    item it holds as a replica in another file. The files received, by name."""
    rank = dist.get_rank(group)
    where = _served_here(copies, manifest)
    mine = {
        receiver: [(name, offset) for name, spans in wanted.items() for offset, _ in spans if (name, offset) in where]
        for receiver, (node, wanted) in enumerate(needs)
        if node != needs[rank][0]
    }
    offers = all_objects(mine, group)
    outgoing: dict[int, list[tuple[str, int, int]]] = {}
    receiving: dict[int, list[tuple[str, int, int]]] = {}
    for receiver, server, name, offset, length in _plan(needs, offers):
        if server == rank:
            outgoing.setdefault(receiver, []).append((*where[(name, offset)], length))
        if receiver == rank:
            receiving.setdefault(server, []).append((name, offset, length))
    placed = Placements(places)
    incoming = {server: _Stream(segments, placed) for server, segments in receiving.items()}
    _post(group, local.root, outgoing, incoming)
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


def fetch_pieces(lengths: list[int]) -> list[int]:
    """The messages a fetch's stream of items of ``lengths`` travels in: each item of at least
    ``ALONE_BYTES`` in its own (pieces of ``FETCH_PIECE_BYTES``), the others together, in order."""
    pieces, together = [], 0
    for length in lengths:
        if length >= ALONE_BYTES or together + length > FETCH_PIECE_BYTES:
            pieces += [together] if together else []
            together = 0
        if length >= ALONE_BYTES:
            pieces += fixed_pieces([length], FETCH_PIECE_BYTES)
        else:
            together += length
    return pieces + ([together] if together else [])


def _post(group: Any, folder: str, outgoing: dict[int, list], incoming: dict[int, "_Stream"]) -> None:
    """Send each rank of ``outgoing`` its byte ranges (file, offset, length) of files in ``folder``, and
    receive every stream of ``incoming``, all at once (``send_and_receive``: both ends derive the messages
    from the same plan, ``fetch_pieces``). No CRC32C travels with a piece: the load checks every block it
    reads (a range that cannot be read is sent as zeros, and fails there)."""
    sends = {
        receiver: (piece for piece, _ in Pieces(folder, files, False, fetch_pieces([n for _, _, n in files])))
        for receiver, files in outgoing.items()
    }
    received = {server: stream.messages for server, stream in incoming.items()}
    send_and_receive(group, received, sends, SENDING_BYTES)


class _Stream:
    """A server's items (``(file, offset, length)``) arriving as one stream of messages (``fetch_pieces``),
    each received in place: an item travelling alone into the memory ``placed`` gives it (its destination
    tensor), every other one into one buffer."""

    def __init__(self, segments: list[tuple[str, int, int]], placed: Placements):
        self.segments = segments
        lengths = [length for _, _, length in segments]
        self.sizes = fetch_pieces(lengths)
        places = [placed.find(n, at, at + length) if length >= ALONE_BYTES else None for n, at, length in segments]
        buffer = torch.empty(sum(n for n, p in zip(lengths, places, strict=True) if p is None), dtype=torch.uint8)
        self.memory = []  # each item's
        at = 0
        for length, place in zip(lengths, places, strict=True):
            if place is None:
                self.memory.append(buffer[at : at + length])
                at += length
            else:
                self.memory.append(as_tensor(place))
        #: the memory each message is received into, in order
        self.messages = self._message_memory(buffer)

    def _message_memory(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The memory each message is received into: part of one item's, or of the buffer (items that
        travel together lie next to each other in it)."""
        out, item, into = [], 0, 0  # the item the next message starts in, and how far into it
        for size in self.sizes:
            memory = self.memory[item]
            if len(memory) - into >= size:
                out.append(memory[into : into + size])
            else:  # items travelling together: consecutive in the buffer
                start = memory.data_ptr() - buffer.data_ptr() + into
                out.append(buffer[start : start + size])
            into += size
            while item < len(self.memory) and into >= len(self.memory[item]):
                into -= len(self.memory[item])
                item += 1
        return out

    def whole(self) -> list[tuple[str, int, torch.Tensor]]:
        """Each item, ``(file, offset, its memory)``, once every message arrived."""
        return [(name, offset, memory) for (name, offset, _), memory in zip(self.segments, self.memory, strict=True)]
