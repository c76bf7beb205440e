"""Read each stored byte once per load: where several ranks need the same stored blocks (HSDP
replicas), one of them reads and checks them and the others get them over the process group.

The coordinator plans (``plan_shared_reads``): consecutive blocks of a stored item needed by the
same set of ranks form a segment (cut at ``MAX_REQUEST_BYTES``), read by the least loaded of
those ranks; segments go into rounds of at most ``budget`` bytes, whole items at a time. Every
rank then runs the rounds in order (``load_shared``): read and check its segments, agree that
every rank succeeded, exchange (point-to-point messages over gloo in an order both sides derive from
the plan: small segments bundled per pair, each segment of at least ``SHARED_READ_MESSAGE_BYTES`` a
message of its own, read and received straight into its destination where its bytes land unchanged),
and load its read items of that round from the bytes it now holds. A failure on any rank becomes the
same error on all.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections import defaultdict
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from ckptio.config import (
    MAX_REQUEST_BYTES,
    SHARED_READ_MESSAGE_BYTES,
    SHARED_READ_MIN_REPLICATION,
    SHARED_READ_MIN_SAVED_BYTES,
)
from ckptio.errors import CheckpointError
from ckptio.format.records import StoredItem
from ckptio.loading.exchange import send_and_receive
from ckptio.loading.fetch import ReadJob, read_pieces, verify_block
from ckptio.loading.host_memory import empty_bytes
from ckptio.loading.ranges import ReadPiece
from ckptio.loading.sources import ByteSource, ItemSource
from ckptio.loading.together import fail_together
from ckptio.storage import ReadRequest

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Blocks ``first..last-1`` of the stored item ``index``: bytes ``start..end`` of ``file``."""

    index: MetadataIndex
    first: int
    last: int
    file: str
    start: int
    end: int
    reader: int
    needers: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class SharedReadPlan:
    """The same on every rank: the rounds of segments, for a load on ``world_size`` ranks."""

    rounds: list[list[Segment]]
    world_size: int


Needs = dict[MetadataIndex, list[tuple[int, int, frozenset[int]]]]


def needed_blocks(
    plans: list[LoadPlan], resolve: Callable[[ReadItem], tuple[MetadataIndex, StoredItem] | None]
) -> Needs:
    """stored key -> runs ``(first block, last block + 1, ranks)``: consecutive blocks that the
    same ranks' read items need. ``resolve`` gives a read item's stored key and record, or None for
    what is not shared (inline, per-rank, unknown keys). Works on block ranges, not single blocks,
    so planning costs O(read items), whatever the checkpoint's size."""
    spans: dict[MetadataIndex, list[tuple[int, int, int]]] = defaultdict(list)
    for rank, plan in enumerate(plans):
        for read_item in plan.items:
            found = resolve(read_item)
            if found is not None:
                key, item = found
                blocks = ReadJob.build(read_item, item).blocks
                run_start = 0
                for i in range(1, len(blocks) + 1):
                    if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
                        spans[key].append((blocks[run_start], blocks[i - 1] + 1, rank))
                        run_start = i
    return {key: _sweep(found) for key, found in spans.items()}


def _sweep(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, frozenset[int]]]:
    """Split overlapping (first, last, rank) spans into runs that one set of ranks needs."""
    events: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for first, last, rank in spans:
        events[first].append((rank, 1))
        events[last].append((rank, -1))
    active: dict[int, int] = defaultdict(int)
    runs: list[tuple[int, int, frozenset[int]]] = []
    points = sorted(events)
    for at, following in zip(points, points[1:] + [None], strict=True):
        for rank, delta in events[at]:
            active[rank] += delta
        ranks = frozenset(r for r, n in active.items() if n > 0)
        if following is not None and ranks:
            if runs and runs[-1][1] == at and runs[-1][2] == ranks:
                runs[-1] = (runs[-1][0], following, ranks)
            else:
                runs.append((at, following, ranks))
    return runs


def needed_bytes(needs: Needs, items: Callable[[MetadataIndex], StoredItem]) -> tuple[int, int]:
    """(stored bytes the ranks need in all, distinct stored bytes among them)."""
    total = distinct = 0
    for index, runs in needs.items():
        offsets = items(index).block_offsets
        for first, last, ranks in runs:
            size = offsets[last] - offsets[first]
            total += size * len(ranks)
            distinct += size
    return total, distinct


def worth_sharing(remote: bool, needed: int, distinct: int) -> bool:
    """``dedup_reads="auto"``: share from remote stores and network filesystems when it saves
    enough reads to outweigh a round of collectives; never from local disks (the page cache
    serves a second read cheaper than the exchange would)."""
    return (
        remote and needed >= SHARED_READ_MIN_REPLICATION * distinct and needed - distinct >= SHARED_READ_MIN_SAVED_BYTES
    )


def plan_shared_reads(
    needs: Needs,
    items: Callable[[MetadataIndex], StoredItem],
    world_size: int,
    budget: int,
) -> SharedReadPlan:
    order = sorted(needs, key=lambda i: (items(i).file, items(i).offset))
    by_item = [
        [_Unassigned(index, first, last, ranks) for first, last, ranks in _runs(items(index), needs[index])]
        for index in order
    ]
    readers = _assign_readers([u for units in by_item for u in units], items, world_size)
    rounds: list[list[Segment]] = [[]]
    round_bytes = 0
    for units in by_item:
        segments = [u.segment(items(u.index), readers[id(u)]) for u in units]
        size = sum(s.size for s in segments)
        if rounds[-1] and round_bytes + size > budget:
            rounds.append([])
            round_bytes = 0
        rounds[-1] += segments
        round_bytes += size
    return SharedReadPlan(rounds, world_size)


@dataclasses.dataclass
class _Unassigned:
    index: MetadataIndex
    first: int
    last: int
    ranks: frozenset[int]

    def segment(self, item: StoredItem, reader: int) -> Segment:
        start, end = item.block_offsets[self.first], item.block_offsets[self.last]
        return Segment(self.index, self.first, self.last, item.file, start, end, reader, tuple(sorted(self.ranks)))


def _assign_readers(units: list[_Unassigned], items: Callable[[MetadataIndex], StoredItem], world: int) -> dict:
    """Each run of consecutive units (file order) that the same ranks need is cut into one
    contiguous stretch per rank, of about equal size, least loaded rank first: every rank reads
    few, long ranges (merged into few requests) and the bytes spread evenly."""
    load = [0] * world
    readers: dict[int, int] = {}
    groups: list[list[_Unassigned]] = []
    for u in units:
        if groups and groups[-1][-1].ranks == u.ranks and items(groups[-1][-1].index).file == items(u.index).file:
            groups[-1].append(u)
        else:
            groups.append([u])
    for group in groups:
        sizes = [items(u.index).block_offsets[u.last] - items(u.index).block_offsets[u.first] for u in group]
        ranks = sorted(group[0].ranks, key=lambda r: (load[r], r))
        share, taken, k = sum(sizes) / len(ranks), 0, 0
        for u, size in zip(group, sizes, strict=True):
            if taken >= share * (k + 1) and k + 1 < len(ranks):
                k += 1
            readers[id(u)] = ranks[k]
            load[ranks[k]] += size
            taken += size
    return readers


def _runs(item: StoredItem, runs: list[tuple[int, int, frozenset[int]]]):
    """``runs`` cut so that none is longer than MAX_REQUEST_BYTES (a long one can then be spread)."""
    offsets = item.block_offsets
    for first, last, ranks in runs:
        start = first
        for b in range(first + 1, last + 1):
            if b == last or offsets[b + 1] - offsets[start] > MAX_REQUEST_BYTES:
                yield start, b, ranks
                start = b


class CachedBlocks:
    """A byte source (``sources.ByteSource``) of the segments this rank holds in a round; a read of
    anything else is a planning bug, not a storage fault. Files are described and sized by the store."""

    read_gap_bytes = 0  # only what was planned is held: a bridged gap may not be
    remote = False

    def __init__(self, store: ByteSource, held: dict[str, list[tuple[int, memoryview]]]):
        self._store, self.url = store, store.url
        self._held = {name: sorted(spans, key=lambda s: s[0]) for name, spans in held.items()}
        self._starts = {name: [start for start, _ in spans] for name, spans in self._held.items()}

    def describe(self, name: str) -> str:
        return self._store.describe(name)

    def size(self, name: str) -> int:
        return self._store.size(name)

    def exists(self, name: str) -> bool:
        return self._store.exists(name)

    def read_into(self, requests: list[ReadRequest]) -> list[int]:
        counts = []
        for request in requests:
            at = request.offset
            for buffer in request.buffers:
                done = 0
                while done < len(buffer):
                    source = self._find(request.name, at + done)
                    n = min(len(buffer) - done, len(source))
                    if memory_address(source) != memory_address(buffer[done:]):  # not exchanged into its place already
                        buffer[done : done + n] = source[:n]
                    done += n
                at += len(buffer)
            counts.append(request.length)
        return counts

    def _find(self, name: str, offset: int) -> memoryview:
        at = bisect.bisect_right(self._starts.get(name, []), offset) - 1  # the last segment starting at or before
        if at >= 0:
            start, data = self._held[name][at]
            if offset < start + len(data):
                return data[offset - start :]
        raise CheckpointError(f"internal error: shared read of {name} at {offset} was not planned for this rank")


def exchange_group() -> Any:
    """The group the bytes travel in: the default one if it carries CPU tensors, else a gloo group
    made once (every rank reaches this at the same point of the load)."""
    global _GLOO_GROUP
    if "gloo" in str(dist.get_backend()):
        return None
    if _GLOO_GROUP is None:
        _GLOO_GROUP = dist.new_group(backend="gloo")
    return _GLOO_GROUP


_GLOO_GROUP = None
_SHARED_FAILURE = "failed reading stored bytes shared with other ranks"


def load_shared(
    store: ByteSource,
    plan: SharedReadPlan,
    triples: list[tuple[MetadataIndex, ReadItem, Any]],
    items: ItemSource,
    planner: LoadPlanner,
    failure: BaseException | None = None,
) -> None:
    """Run the rounds of ``plan`` on this rank: read its segments (checked against ``items``' records
    when it verifies), exchange, then deliver its shared ``(stored key, read item, item)`` triples from
    the bytes held: ``items.prepare`` first gives the places where stored bytes may land unchanged,
    which segments are read and received straight into (``Placements``), and ``items.deliver`` then
    reads from the held bytes (``CachedBlocks``). ``failure``: what already went wrong on this rank (it
    still takes part in the first agreement, so every rank raises instead of waiting)."""
    rank, group = dist.get_rank(), exchange_group()
    by_index: dict[MetadataIndex, list[tuple[ReadItem, Any]]] = defaultdict(list)
    for key, read_item, source in triples:
        by_index[key].append((read_item, source))
    for segments in plan.rounds:
        mine = [pair for index in dict.fromkeys(s.index for s in segments) for pair in by_index.pop(index, [])]
        prepared: Any = None
        if failure is None:
            try:
                prepared = items.prepare(mine, planner, places=True)
                exchange = _Exchange(segments, rank, Placements(prepared.places))
                _read_segments(store, exchange.own, items)
            except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement below
                failure = exc
        fail_together(failure, group, _SHARED_FAILURE)
        held = exchange.run(group)
        spans: dict[str, list[tuple[int, memoryview]]] = defaultdict(list)
        for segment, data in held.items():
            spans[segment.file].append((segment.start, data))
        try:
            items.deliver(CachedBlocks(store, spans), prepared, planner)
        except Exception as exc:  # noqa: BLE001
            failure = exc
    fail_together(failure, group, _SHARED_FAILURE)


def _read_segments(store: ByteSource, own: dict[Segment, memoryview], items: ItemSource) -> None:
    """Read this rank's segments into ``own`` and check every block (the rank that reads is the
    one that names a damaged block first)."""
    # no gaps bridged: the bytes between two of this rank's segments are another rank's to read
    read_pieces(store, [ReadPiece(s.file, s.start, data) for s, data in own.items()], items.file_sizes(), gap=0)
    for s, data in own.items() if items.verify else ():
        item = items.stored_record(s.index)
        for b in range(s.first, s.last):
            lo, hi = item.block_offsets[b] - s.start, item.block_offsets[b + 1] - s.start
            verify_block(item, b, [data[lo:hi]], f"key {s.index.fqn!r} in {s.file}")


class Placements:
    """Where this rank wants stored bytes to land unchanged: a segment that lies wholly inside one
    ``(file, offset, memory)`` place is read or received into that part of its memory (a destination
    tensor), not into a buffer (fresh memory costs a page fault per page, which on the bench's VM
    cost more than the read)."""

    def __init__(self, places: list[tuple[str, int, memoryview]]):
        runs: dict[str, list[tuple[int, memoryview]]] = defaultdict(list)
        for file, start, dest in places:
            runs[file].append((start, dest))
        self._runs = {file: sorted(found, key=lambda r: r[0]) for file, found in runs.items()}
        self._starts = {file: [start for start, _ in found] for file, found in self._runs.items()}

    def __call__(self, segment: Segment) -> memoryview | None:
        return self.find(segment.file, segment.start, segment.end)

    def find(self, file: str, start: int, end: int) -> memoryview | None:
        """The memory bytes ``start:end`` of ``file`` land in unchanged, or ``None``."""
        at = bisect.bisect_right(self._starts.get(file, []), start) - 1
        if at < 0:
            return None
        first, dest = self._runs[file][at]
        if end > first + len(dest):
            return None
        return dest[start - first : end - first]


class _Exchange:
    """One round's exchange, point to point. Between two ranks, the segments one reads and the other
    needs travel in a fixed order both derive from the plan (``_messages``): the small ones together
    in one message, copied in and out of a buffer, then each segment of at least
    ``SHARED_READ_MESSAGE_BYTES`` as a message of its own, sent from and received into wherever
    each rank holds it (its destination tensor when ``placed`` gives one), so nothing is copied;
    a segment several peers need is sent to each from the same memory."""

    def __init__(self, segments: list[Segment], rank: int, placed: Callable[[Segment], Any]):
        self.segments, self.rank, self.placed = segments, rank, placed
        self.exchanged = any(len(s.needers) > 1 for s in segments)  # the same answer on every rank
        read = [s for s in segments if s.reader == rank]
        self.own = {s: view for s in read if rank in s.needers and (view := placed(s)) is not None}
        unplaced = [s for s in read if s not in self.own]
        self.own.update(zip(unplaced, _slices(empty_bytes(_total(unplaced)), unplaced), strict=True))

    def run(self, group: Any) -> dict[Segment, memoryview]:
        """Send and receive; every segment this rank needs, by segment."""
        held = {s: data for s, data in self.own.items() if self.rank in s.needers}
        if not self.exchanged:
            return held
        to_peer: dict[int, list[Segment]] = defaultdict(list)
        from_peer: dict[int, list[Segment]] = defaultdict(list)
        for s in self.segments:
            if s.reader == self.rank:
                for peer in s.needers:
                    if peer != self.rank:
                        to_peer[peer].append(s)
            elif self.rank in s.needers:
                from_peer[s.reader].append(s)
        incoming: dict[int, list[torch.Tensor]] = {}
        for peer, segments in from_peer.items():
            for message in _messages(segments):
                buffer, views = self._incoming(message)
                held.update(views)
                incoming.setdefault(peer, []).append(as_tensor(buffer))
        outgoing = {
            peer: [as_tensor(self._outgoing(message)) for message in _messages(segments)]
            for peer, segments in to_peer.items()
        }
        send_and_receive(group, incoming, outgoing)
        return held

    def _outgoing(self, message: list[Segment]) -> memoryview:
        if len(message) == 1:
            return self.own[message[0]]
        buffer = memoryview(empty_bytes(_total(message)))
        for s, view in zip(message, _slices(buffer, message), strict=True):
            view[:] = self.own[s]
        return buffer

    def _incoming(self, message: list[Segment]) -> tuple[memoryview, dict[Segment, memoryview]]:
        """The buffer a message is received into, and the segment views it holds."""
        if len(message) == 1:
            view = self.placed(message[0])
            if view is not None:
                return view, {message[0]: view}
        buffer = memoryview(empty_bytes(_total(message)))
        return buffer, dict(zip(message, _slices(buffer, message), strict=True))


def _messages(sent: list[Segment]) -> list[list[Segment]]:
    """The segments one rank sends another in a round (in plan order), message by message: the small
    ones together, then each large one alone. Both ranks derive the same list, so the message
    number is the tag that pairs each send with its receive."""
    sent = [s for s in sent if s.size > 0]
    small = [s for s in sent if s.size < SHARED_READ_MESSAGE_BYTES]
    return ([small] if small else []) + [[s] for s in sent if s.size >= SHARED_READ_MESSAGE_BYTES]


def as_tensor(buffer: memoryview) -> torch.Tensor:
    """``buffer``'s bytes as a uint8 tensor over the same memory (what gloo sends from and receives into)."""
    return torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8))


def memory_address(view: memoryview) -> int:
    """Where ``view``'s first byte lies in memory (0 when empty): bytes received in place are not copied."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def _total(segments: list[Segment]) -> int:
    return sum(s.size for s in segments)


def _slices(buffer: Any, segments: list[Segment]) -> list[memoryview]:
    """Views of ``buffer`` for ``segments``, back to back in order."""
    view, at, out = memoryview(buffer).cast("B"), 0, []
    for s in segments:
        out.append(view[at : at + s.size])
        at += s.size
    return out
