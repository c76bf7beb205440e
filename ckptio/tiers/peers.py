"""A tiered load's reads from other nodes: files a rank's load needs that its node does not hold are
fetched, whole with their held index, from a node that does (its own copy, or a partner's copy:
``replication.py``), over the load's process group, before the load reads. They are kept in memory
for this load (a replacement node restarts without writing them first: the restart waits for nothing
but the network) and stand in for the checkpoint's files exactly as a node's own copy does: each piece
is checked on arrival, the file against its held index, the index against the checkpoint's records
(``held_index.add_copy``), and every block again as the load reads it.

Which files: those the rank's plan reads from that its node lacks. Each is sent by a holder on another
node (spread over the holders); a file no node holds is read from the durable tier. A replacement node
holds its ranks' copies again after their next save.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ckptio.format.codec import checksum
from ckptio.format.records import Manifest
from ckptio.loading.read_once import DIRECT
from ckptio.storage import FsspecStore
from ckptio.tiers.held_index import HeldIndex, LocalCopies, add_copy, blocks_of
from ckptio.tiers.nodes import this_node
from ckptio.tiers.paths import HELD_SUFFIX
from ckptio.tiers.replication import move_files

log = logging.getLogger(__name__)


def fetch_from_peers(
    group: Any, local: FsspecStore, copies: LocalCopies, needed: set[str], manifest: Manifest
) -> dict[str, memoryview]:
    """Fetch ``needed`` (file names this rank reads, not on its node) from other nodes; every rank of
    ``group`` calls it (each sends what others need of its node's copies). Returns the files received and
    checked, by name, and adds them to ``copies`` (none without a process group)."""
    if group is DIRECT or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {}
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    offered = {name: [size, _index_size(local, name)] for name, size in copies.sizes.items()}
    view = (this_node(), sorted(needed), {name: sizes for name, sizes in offered.items() if sizes[1] is not None})
    views: list = [None] * world
    dist.all_gather_object(views, view, group=group)
    outgoing: dict[int, list[tuple[str, int]]] = {}
    receiving: dict[int, list[tuple[str, int]]] = {}
    for receiver, holder, name in _plan(views):
        size, index_size = views[holder][2][name]
        files = [(name, size), (name + HELD_SUFFIX, index_size)]
        if holder == rank:
            outgoing.setdefault(receiver, []).extend(files)
        if receiver == rank:
            receiving.setdefault(holder, []).extend(files)
    incoming = {holder: _InMemory(files, holder) for holder, files in receiving.items()}
    move_files(group, local.root, outgoing, incoming)
    fetched = {}
    for arrivals in incoming.values():
        for name, data in arrivals.checked().items():
            if add_copy(copies, HeldIndex.decode(arrivals.index_bytes(name)), len(data), manifest):
                fetched[name] = data
    return fetched


def _plan(views: list) -> list[tuple[int, int, str]]:
    """``(receiving rank, sending rank, file)`` of each fetch: a file a rank needs and its node lacks, from
    a rank of another node that holds it (spread over them)."""
    fetches = []
    for receiver, (node, needed, _) in enumerate(views):
        for name in needed:
            if any(n == node and name in held for n, _, held in views):
                continue  # the node holds it
            holders = [r for r, (n, _, held) in enumerate(views) if n != node and name in held]
            if holders:
                fetches.append((receiver, holders[len(fetches) % len(holders)], name))
    return fetches


def _index_size(local: FsspecStore, name: str) -> int | None:
    try:
        return local.size(name + HELD_SUFFIX)
    except Exception:  # noqa: BLE001 - a cache: a copy whose index cannot be sized is not offered
        return None


class _InMemory:
    """A holder's files arriving piece by piece (``replication.move_files``), received in place into one
    buffer per file."""

    def __init__(self, files: list[tuple[str, int]], source: int):
        self.files, self.source = files, source
        self.count = sum(-(-size // _piece_bytes()) for _, size in files)
        self.received = {name: torch.empty(size, dtype=torch.uint8) for name, size in files}
        self._broken: set[str] = set()
        self._at, self._written = 0, 0

    @property
    def expecting(self) -> bool:
        return self._at < len(self.files)

    def buffer_for(self, length: int) -> torch.Tensor:
        """Where the next piece (``length`` bytes) lands: its place in its file's buffer."""
        name, size = self.files[self._at]
        if self._written + length > size:
            return torch.empty(length, dtype=torch.uint8)  # a peer out of step: take it, and fail the check
        return self.received[name][self._written : self._written + length]

    def take(self, data: memoryview, whole: bool) -> None:
        name, size = self.files[self._at]
        if not whole or self._written + len(data) > size:
            self._broken.add(name)
        self._written += len(data)
        if self._written >= size:
            self._at, self._written = self._at + 1, 0

    def checked(self) -> dict[str, memoryview]:
        """The data files that arrived whole and hold every block their index lists."""
        out = {}
        for name, _ in self.files:
            if name.endswith(HELD_SUFFIX) or name in self._broken or name + HELD_SUFFIX in self._broken:
                continue
            try:
                index = HeldIndex.decode(self.index_bytes(name))
                data = memoryview(self.received[name].numpy())
                problem = None if index.file == name else f"its index describes {index.file}"
                problem = problem or _damage(data, index)
            except (ValueError, KeyError, TypeError) as exc:
                problem = f"its index cannot be read: {exc}"
            if problem:
                log.warning("ckptio: the copy of %s fetched from rank %d is damaged (%s)", name, self.source, problem)
                continue
            out[name] = data
        return out

    def index_bytes(self, name: str) -> bytes:
        return self.received[name + HELD_SUFFIX].numpy().tobytes()


def _damage(data: memoryview, index: HeldIndex) -> str | None:
    if len(data) != index.local_bytes:
        return f"it holds {len(data)} bytes, its index records {index.local_bytes}"
    for offset, length, crc in blocks_of(index):
        if offset + length > len(data) or checksum(data[offset : offset + length]) != crc:
            return f"the block at byte {offset} fails its CRC32C"
    return None


def _piece_bytes() -> int:
    from ckptio.tiers.replication import PIECE_BYTES

    return PIECE_BYTES
