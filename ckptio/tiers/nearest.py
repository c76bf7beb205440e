"""A tiered load's reads (``loading/read_tier.py``): the metadata committed at the URL (or, while the
drain has not committed, the node's copy: ``reading.tiered_metadata_bytes``), and each byte from the
nearest tier holding a verified copy: the files this node holds whole and the replicas its ranks kept
(``held_index.local_copies``) from the fast tier, the rest from the durable tier. A fast-tier file that
fails a check is dropped and its items read again from the durable tier."""

from __future__ import annotations

import logging
from typing import Any, Callable

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from ckptio.errors import CorruptCheckpointError
from ckptio.format.records import Manifest, StoredItem
from ckptio.loading.extents import byte_source
from ckptio.loading.read_once import DIRECT
from ckptio.loading.read_tier import DurableReads, register_tiered
from ckptio.loading.safe_load import restore_objects_under_held_keys
from ckptio.storage import FsspecStore
from ckptio.tiers.drain import load_ended
from ckptio.tiers.held_index import LocalCopies, local_copies
from ckptio.tiers.paths import local_step_store
from ckptio.tiers.peers import FetchedFile, fetch_from_peers, gather_needs, needed_items
from ckptio.tiers.reading import TieredSource, tiered_metadata_bytes

log = logging.getLogger(__name__)


class NearestTierReads(DurableReads):
    shares_reads = False  # each node reads what it holds from its own fast tier

    def __init__(self, reader: Any):
        super().__init__(reader)
        self.copies = LocalCopies()
        self.group: Any = DIRECT  # the load's process group, once its metadata is read over it
        self.fetched: dict[str, FetchedFile] = {}  # what this load fetched from other nodes

    def metadata_bytes(self, read_durable: Callable[[], bytes], group: Any) -> bytes | None:
        self.group = group
        durable = self.reader._open_store()
        return tiered_metadata_bytes(
            self.local_store(), read_durable, lambda: durable.list_sizes() or {}, group, DIRECT
        )

    def set_up(self, manifest: Manifest) -> None:
        self.copies = local_copies(self.local_store(), manifest)

    def record_for(self, index: MetadataIndex, item: StoredItem) -> StoredItem:
        if item.file in self.copies.files:
            return item
        return self.copies.relocated.get(index, item)

    def read(self, plan: LoadPlan, planner: LoadPlanner) -> bool:
        """Read from the nearest tier; ``reader.bytes_read`` says how many bytes each tier served."""
        r = self.reader
        restore_objects_under_held_keys(planner, plan)
        local, durable = self.local_store(), byte_source(r._open_store(), r.manifest)
        r.bytes_read = {"local": 0, "peer": 0, "durable": 0}
        try:
            pairs = [(read_item, r.item_for(read_item)) for read_item in plan.items]
            lacking = needed_items([item for _, item in pairs], self.copies.local_files, r.manifest.files)
            needs = gather_needs(self.group, lacking)
            # where this rank fetches, its destinations first: what lands unchanged is received into place
            prepared, failure = None, None
            try:
                prepared = r.prepare(pairs, planner, places=bool(lacking))
            except Exception as exc:  # noqa: BLE001 - raised once this rank has served the others
                failure = exc
            if needs is not None:
                places = prepared.places if prepared else []
                self.fetched = fetch_from_peers(self.group, needs, local, self.copies, r.manifest, places)
            if failure is not None:
                raise failure
            self._read(plan, planner, local, durable, prepared)
        finally:
            load_ended()  # a drain ckptio.latest resumed behind this restart goes now
        return True

    def _read(self, plan: LoadPlan, planner: LoadPlanner, local: FsspecStore, durable: Any, prepared: Any) -> None:
        r = self.reader
        while True:
            pairs = [(read_item, r.item_for(read_item)) for read_item in plan.items]
            names = self.copies.local_files
            nearer = names | set(self.fetched)
            reads_durable = any(item.file and item.file not in nearer for _, item in pairs)
            source = TieredSource(local, durable, names, reads_durable, self.fetched)
            try:
                r.deliver(source, prepared or r.prepare(pairs, planner, places=False), planner)
                break
            except CorruptCheckpointError as exc:
                if exc.file not in names and exc.file not in self.fetched:
                    raise
                log.warning(
                    "ckptio: the copy %s failed its check (%s); reading it from %s instead",
                    source.describe(exc.file),
                    exc,
                    durable.url,
                )
                self._drop(exc.file)
                prepared = None  # delivered in part: prepared again
            finally:
                for tier, count in source.bytes_read.items():
                    r.bytes_read[tier] += count
        log.info(
            "ckptio: loaded %s: %d bytes from this node's fast tier, %d from copies fetched from other nodes, "
            "%d from the durable tier",
            r.checkpoint_id,
            r.bytes_read["local"],
            r.bytes_read["peer"],
            r.bytes_read["durable"],
        )

    def _drop(self, name: str) -> None:
        self.fetched.pop(name, None)
        self.copies.drop(name)

    def local_store(self) -> FsspecStore:
        r = self.reader
        return local_step_store(r.local_tier, r.checkpoint_id, r.storage_options, r.storage_config)


register_tiered(NearestTierReads)
