"""Where a save's bytes land and how it commits: on the durable URL, here; or on a node's fast tier with
a drain to the durable URL behind it (``tiers/landing.py``, chosen by ``WriterConfig.local_tier``). The
Writer asks its landing at each step and never branches on tiers itself; ``tiers`` registers its landing
when the package is imported, so ``saving`` imports nothing of ``tiers``."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem

from ckptio.format.records import Header, StoredItem
from ckptio.saving.commit import check_target, clear_for_fragments, publish, publish_fragment
from ckptio.saving.data_file import encode_items, item_bytes
from ckptio.saving.merge_once import merge_when_complete


class DurableLanding:
    """A save straight to its URL: data files, then ``ckptio.json`` (or a rank's fragment) published there."""

    #: how long after the save its commit may come (references keep the base's files that long)
    pending_s = 0.0

    def __init__(self, writer: Any):
        self.writer = writer  # the ``Writer`` of the save (its location, config, rank and this save's state)

    def start(self) -> None:
        """A save begins (every rank)."""

    def check_target(self) -> list[str]:
        """The coordinator, before a save with one: refuse to replace a committed checkpoint unless
        overwriting; the data files an overwrite supersedes."""
        return check_target(self.writer._open_store(), self.writer.config.overwrite)

    def clear_for_fragments(self) -> None:
        """Rank 0, before a save without a coordinator (``commit.clear_for_fragments``)."""
        clear_for_fragments(self.writer._open_store(), self.writer.config.overwrite)

    def write(
        self,
        file: str,
        durable_items: dict[MetadataIndex, WriteItem],
        replicas: dict[MetadataIndex, WriteItem],
        planner: SavePlanner,
        objects: dict[MetadataIndex, memoryview],
        inline_limit: int,
    ) -> dict[MetadataIndex, StoredItem]:
        """Store this rank's ``durable_items`` in data file ``file`` (``replicas``, what it holds that
        others write, are not its to store here); their records."""
        if not durable_items:
            return {}
        w = self.writer
        store = w._open_store()
        store.prepare_directory()
        items = item_bytes(durable_items, planner, objects)
        return encode_items(store, file, items, w.config, inline_limit, w._base)

    #: where this rank's items referencing a base still draining lie whole (a tiered save: ``tiers/rebase.py``)
    full_copy: dict | None = None

    def written(self, records: dict) -> None:
        """This rank's part of the save is written (``records``); a direct save has nothing to note."""

    def commit(
        self, document: bytes, header: Header, writers: dict[str, int], superseded: list[str], full: Any = None
    ) -> None:
        """The coordinator: publish ``ckptio.json``, create-only unless overwriting. (``full``: the same save
        made full, for a tiered save whose base may not arrive.)"""
        w = self.writer
        publish(w._open_store(), document, header.files, superseded, w.config.overwrite)

    def finished(self) -> None:
        """This rank's part of the commit has ended, committed or not (``Writer.finish``)."""

    def commit_fragment(self, name: str, document: bytes, files: dict[str, int], merge: tuple[str, int] | None) -> None:
        """A rank of a save without a coordinator: publish its fragment; rank 0 (``merge``: the save's id
        and rank count) then merges the set once every rank's is there."""
        w = self.writer
        store = w._open_store()
        publish_fragment(store, name, document, files, w.config.overwrite)
        if merge is not None:
            merge_when_complete(store.url, w.storage_options, w.storage_config, *merge)


_TIERED: list[Any] = []


def register_tiered(landing: type) -> None:
    """``tiers`` registers its landing here (``tiers/landing.py``)."""
    _TIERED[:] = [landing]


def landing_for(writer: Any) -> DurableLanding:
    if not writer.config.local_tier:
        return DurableLanding(writer)
    if not _TIERED:  # ckptio/__init__ imports ckptio.tiers, which registers it
        raise RuntimeError("internal error: ckptio.tiers did not register its landing; import ckptio first")
    return _TIERED[0](writer)
