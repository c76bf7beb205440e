"""Where a load reads from: the checkpoint's URL alone, here; or each byte from the nearest tier that
holds a verified copy (``tiers/nearest.py``, for ``Reader(local_tier=...)``). The Reader asks its read
tier at each step and never branches on tiers itself; ``tiers`` registers its own when ``ckptio`` is
imported, so ``loading`` imports nothing of ``tiers``."""

from __future__ import annotations

from typing import Any, Callable

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from ckptio.format.records import Manifest, StoredItem


class DurableReads:
    """A load from the checkpoint's URL alone."""

    #: whether the ranks may share reads (``Reader(dedup_reads=...)``)
    shares_reads = True

    def __init__(self, reader: Any):
        self.reader = reader  # the ``Reader`` of the load (its location, config and this load's state)

    def metadata_bytes(self, read_durable: Callable[[], bytes], group: Any) -> bytes | None:
        """The metadata document to decode, read over ``group``; ``None``: the Reader reads it as usual."""
        return None

    def set_up(self, manifest: Manifest) -> None:
        """The load's metadata is known (every rank)."""

    def record_for(self, index: MetadataIndex, item: StoredItem) -> StoredItem:
        """Where this load reads ``item`` (stored under ``index``) from."""
        return item

    def read(self, plan: LoadPlan, planner: LoadPlanner) -> bool:
        """Read ``plan``'s items; ``False``: the Reader reads them from the durable store as usual."""
        return False


_TIERED: list[Any] = []


def register_tiered(reads: type) -> None:
    """``tiers`` registers its reads here (``tiers/nearest.py``)."""
    _TIERED[:] = [reads]


def reads_for(reader: Any) -> DurableReads:
    if not reader.local_tier:
        return DurableReads(reader)
    if not _TIERED:  # ckptio/__init__ imports ckptio.tiers, which registers it
        raise RuntimeError("internal error: ckptio.tiers did not register its reads; import ckptio first")
    return _TIERED[0](reader)
