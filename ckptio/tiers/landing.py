"""A tiered save's landing (``saving/landing.py``): every rank's copy on its node's fast tier, committed
there at once; the durable part uploaded, and the checkpoint committed on the durable tier, by the drain
(``writing.py``, ``drain.py``). A full fast tier sends a rank's data straight to the durable tier."""

from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures import Future
from typing import Any, Iterator

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ckptio.errors import StorageError
from ckptio.format.names import METADATA_NAME, fragment_name
from ckptio.format.records import Header, StoredItem
from ckptio.saving.commit import check_target
from ckptio.saving.incremental import note_queued
from ckptio.saving.landing import DurableLanding, register_tiered
from ckptio.saving.save_metadata import written
from ckptio.storage import FsspecStore
from ckptio.tiers import lag, replication, writing
from ckptio.tiers.drain import Durable, drain_queue
from ckptio.tiers.paths import HELD_SUFFIX, local_step_path, local_step_store
from ckptio.tiers.rebase import Rebase

log = logging.getLogger(__name__)


class TieredLanding(DurableLanding):
    @property
    def pending_s(self) -> float:  # type: ignore[override]
        return self.writer.config.tuning.drain_timeout_s

    def start(self) -> None:
        drain_queue().raise_failure()  # a failed background upload of an earlier save is raised here
        w = self.writer
        lag.save_begins(drain_queue(), w.checkpoint_id, w.config, says=w.rank == 0)
        replication.settle_documents()  # an earlier save that did not commit has no document to copy
        self._document: Future = replication.resolved(None)
        self._on_tier = False  # this rank's part landed on the fast tier (``written``)
        self.full_copy = None  # where its items referencing a base still draining lie whole (``rebase.py``)
        self._full_upload = None  # their upload, should the commit rebase the save

    def check_target(self) -> list[str]:
        """A direct save's check, on a durable tier this save need not reach (when it is unreachable, the
        save goes on to the fast tier, whose commit stays create-only); then the node's own committed copy."""
        w = self.writer
        try:
            superseded = super().check_target()
        except StorageError as exc:
            log.warning("ckptio: cannot check the durable tier before a tiered save; saving to the fast tier: %s", exc)
            superseded = []
        writing.refuse_live_copy(w.config, w.checkpoint_id, w.storage_options)
        return superseded

    def clear_for_fragments(self) -> None:
        """Refuse a committed checkpoint now; an overwrite clears it after rank 0's upload
        (``drain.CommitFragment``): the durable tier keeps its checkpoint until then."""
        try:
            check_target(self.writer._open_store(), self.writer.config.overwrite)
        except BaseException:  # the other ranks go on alone to write: their partners still get this rank's offer
            self._offer(self._replication_job(), [])
            raise

    def write(
        self,
        file: str,
        durable_items: dict[MetadataIndex, WriteItem],
        replicas: dict[MetadataIndex, WriteItem],
        planner: SavePlanner,
        objects: dict[MetadataIndex, memoryview],
        inline_limit: int,
    ) -> dict[MetadataIndex, StoredItem]:
        """Everything this rank holds on the fast tier, its durable part's upload queued; straight to the
        durable tier when the fast tier is full. With ``local_tier_copies``, its files' copying to partner
        nodes is queued too, whatever happens here (each partner expects one offer per save)."""
        with self._copied_to_partners(file):
            return self._write(file, durable_items, replicas, planner, objects, inline_limit)

    @contextlib.contextmanager
    def _copied_to_partners(self, file: str) -> Iterator[None]:
        """Queue this rank's copies of the save once its files are written (none if writing them failed)."""
        job = self._replication_job()
        written: list[str] = []
        try:
            yield
            written = self._files_here(file) if job is not None else []
        except BaseException:
            self._offer(job, [])
            raise
        self._offer(job, written, failed=False)

    def _offer(self, job: replication.Replicate | None, written: list[str], failed: bool = True) -> None:
        """Queue ``job``, this rank's offer of ``written`` to its partners (each expects one offer a save);
        ``failed``: refused or failed, no commit follows, the partners are told there is no document."""
        if failed:
            self.finished()
        if job is not None:
            job.files.set_result(written)
            replication.replication_queue().submit(self.drain_key(), job, self.writer.config.tuning.drain_timeout_s)

    def _replication_job(self) -> replication.Replicate | None:
        w = self.writer
        if w.config.local_tier_copies < 2:
            return None
        alone = w._fragment is not None
        members = replication.save_members(w._fragment.members if alone else None, alone)
        link = replication.link_of_save(members, w.config.local_tier_copies)
        if link is None:
            return None
        if w.is_coordinator or alone:  # commits on the node: its document follows its files
            self._document = replication.document_future()
        folder = local_step_path(w.config.local_tier, w.checkpoint_id, w.storage_options)
        return replication.Replicate(link, w.checkpoint_id, folder, Future(), self._document)

    def _files_here(self, file: str) -> list[str]:
        """This rank's files of the save on the fast tier (none where it was full)."""
        local = self.local_store()
        names = [file, file + HELD_SUFFIX]
        if self.writer._base is not None:
            names += [writing.full_copy_name(file), writing.full_copy_name(file) + HELD_SUFFIX]
        return [name for name in names if os.path.exists(local.path(name))]

    def _write(
        self, file: str, durable_items: dict, replicas: dict, planner: SavePlanner, objects: dict, inline_limit: int
    ) -> dict:
        w, alone = self.writer, self.writer._fragment is not None
        if alone:
            name = fragment_name(w.rank, w._fragment.ranks)
            writing.refuse_committed_fragment(self.local_store(), w._open_store(), name, w._fragment.save_id, w.config)
        writing.begin_on_node(self.local_store(), w._started_unix, w._fragment.save_id if alone else None)
        if not alone and not (durable_items or replicas):
            if not w.is_coordinator:
                writing.queue_prune(self.drain_key(), self.durable(), w.config)
            return {}
        local = self.local_store()
        written = writing.write_rank_copy(
            local, file, durable_items, replicas, planner, objects, w.config, inline_limit, w._base
        )
        records, nbytes, full_copy = written if written else (None, 0, None)
        self._on_tier = records is not None
        self.full_copy = full_copy.records if full_copy is not None else None
        self._full_upload = writing.queue_rank_drain(
            self.drain_key(),
            self.durable(),
            local,
            file,
            (records or {}).values(),
            nbytes,
            w.config,
            w.is_coordinator or alone,  # a rank of a save without one commits its own fragment
            w._started_unix,
            full_copy,
        )
        if records is None:  # the fast tier is full
            return super().write(file, durable_items, replicas, planner, objects, inline_limit)
        return records

    def written(self, records: dict) -> None:
        """The next save may reference this one while it drains (``incremental.note_queued``); not a save
        without a coordinator (each rank commits its own fragment), nor one the full fast tier sent direct."""
        w, key = self.writer, self.drain_key()
        if w._fragment is None and w.config.incremental_from is not None and self._on_tier:
            _, files, _ = written([[WriteResult(index, r.stored_bytes, r) for index, r in records.items()]], [])
            note_queued(w.checkpoint_id, records, files, w._base, lambda: drain_queue().state(key))

    def commit(
        self, document: bytes, header: Header, writers: dict[str, int], superseded: list[str], full: Any = None
    ) -> None:
        """On the node now (and on its partners); on the durable tier once every rank's upload is there. (A
        save against a base still draining: ``full``, the same save made full, if that base does not arrive.)"""
        writing.commit_locally(self.local_store(), document)
        _resolve(self._document, (METADATA_NAME, document))
        writing.queue_commit(
            self.drain_key(),
            self.durable(),
            document,
            header,
            writers,
            superseded,
            self.writer.config,
            writing.step_folder(self.local_store()),
            Rebase(*full, upload=self._full_upload) if full is not None else None,
        )

    def commit_fragment(self, name: str, document: bytes, files: dict[str, int], merge: tuple[str, int] | None) -> None:
        """On the node now (and on its partners); on the durable tier after this rank's upload, merged there
        by rank 0."""
        w = self.writer
        _resolve(self._document, (name, document))
        writing.commit_fragment(
            self.drain_key(),
            self.local_store(),
            self.durable(),
            name,
            document,
            files,
            merge,
            w.config,
            w._fragment.save_id,
        )

    def finished(self) -> None:
        """A commit that failed sends its copies without a document (partners wait for nothing)."""
        if not self._document.done():
            self._document.set_result(None)

    def local_store(self) -> FsspecStore:
        w = self.writer
        return local_step_store(w.config.local_tier, w.checkpoint_id, w.storage_options, w.storage_config)

    def durable(self) -> Durable:
        w = self.writer
        return Durable(w.checkpoint_id, dict(w.storage_options), w.storage_config)

    def drain_key(self) -> str:
        return f"{self.writer.checkpoint_id}#{self.writer._save_id}"


def _resolve(future: Future, document: tuple[str, bytes]) -> None:
    if not future.done():
        future.set_result(document)


register_tiered(TieredLanding)
