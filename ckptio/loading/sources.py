"""The two interfaces of the load path.

A **byte source** is where a load reads stored bytes from: a store (``ckptio.storage``), or, during a
shared-read round, the bytes this rank holds (``shared_reads.CachedBlocks``). A **item source** is what
a reader loads: a ckptio checkpoint (``Reader``) or safetensors files (``HFReader``). Plain reads and
shared reads use both the same way::

    record = items.stored_record(key)            # shared-read planning: where an item's bytes are
    source = items.item_for(read_item)           # what one DCP read request reads
    prepared = items.prepare(pairs, planner)     # destinations resolved; places bytes land unchanged
    items.deliver(bytes_source, prepared, planner)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Protocol

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ckptio.format.records import StoredItem
from ckptio.storage import ReadRequest


class ByteSource(Protocol):
    """Stored bytes by file name and offset."""

    url: str
    #: reads this close together are merged into one (0: never bridge a gap)
    read_gap_bytes: int
    #: whether a request crosses a network (an object store, NFS): a load then batches its requests.
    #: Else a read costs about its copy, and each decoding thread reads the blocks it decodes, into
    #: memory it reuses, while they are still in its cache.
    remote: bool

    def read_into(self, requests: list[ReadRequest]) -> list[int]:
        """Fill each request's buffers from its file; the bytes each got (short at a file's end)."""

    def describe(self, name: str) -> str:
        """A file's full location, for messages."""

    def size(self, name: str) -> int:
        """A file's size in bytes (``FileNotFoundError`` when it is missing)."""

    def exists(self, name: str) -> bool: ...


@dataclasses.dataclass
class Prepared:
    """Read requests made ready to deliver: the item source's own batch (``batch``), and the places
    ``(file, offset, memory)`` where stored bytes may land unchanged (shared reads read and receive
    segments straight into them)."""

    batch: Iterable[Any]
    places: list[tuple[str, int, memoryview]] = dataclasses.field(default_factory=list)


class ItemSource(Protocol):
    """The items a reader loads, and how."""

    #: every block read is checked against its checksum
    verify: bool

    def file_sizes(self) -> dict[str, int]:
        """The size each data file should have (named in truncation errors)."""

    def stored_record(self, key: MetadataIndex) -> StoredItem:
        """The stored bytes of the item at ``key``, as blocks (what shared reads plan and check)."""

    def item_for(self, read_item: ReadItem) -> Any:
        """What a DCP read request reads (a stored item, a tensor in a file); named error if none."""

    def prepare(self, pairs: list[tuple[ReadItem, Any]], planner: LoadPlanner, *, places: bool) -> Prepared:
        """``(read item, item)`` pairs made ready: with ``places``, every destination is resolved now
        and the places where bytes land unchanged are listed; else destinations may be resolved as
        delivery reaches them."""

    def deliver(self, source: ByteSource, prepared: Prepared, planner: LoadPlanner) -> None:
        """Read, check and hand the prepared items to ``planner`` from ``source``."""
