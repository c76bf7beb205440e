"""The DCP StorageWriter: plan -> encode -> store -> commit, each step delegated.

Each writing rank streams its items, block by block, into one data file; the coordinator
publishes ``ckptio.json`` only after every rank's file is durable, so a checkpoint is
loadable exactly when it is complete. Who writes what is ``planning.py``'s (or, without a
coordinator, ``fragments.py``'s); where the bytes land and how the save commits, the landing's
(``landing.py``, and ``tiers/landing.py`` for a tiered save).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptio.config import StorageConfig, WriterConfig
from ckptio.errors import CheckpointError
from ckptio.format.document import encode_metadata
from ckptio.format.names import METADATA_NAME, ItemKind, data_file_name
from ckptio.format.records import Header, MeshRecord
from ckptio.gc_pause import paused_gc
from ckptio.saving import fragments, ordering, staging
from ckptio.saving.consistency import (
    ObjectReport,
    attach_report,
    own_copies,
    per_rank_values,
    split_reports,
    value_digests,
)
from ckptio.saving.data_file import pickled_objects
from ckptio.saving.incremental import Base, note_saved, resolve_base
from ckptio.saving.landing import landing_for
from ckptio.saving.merge_once import settle
from ckptio.saving.planning import Holdings, assign_writers
from ckptio.saving.references import by_sibling, mark_references
from ckptio.saving.save_metadata import (
    chain_of,
    check_same_location,
    header_of,
    refuse_unloadable,
    with_records,
    written,
)
from ckptio.state.keys import canonical_planner_data, canonical_write_items
from ckptio.storage import open_store
from ckptio.storage.location import CheckpointLocation
from ckptio.torch_seam import cached_save_plan_items

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RankAssignment:
    """What the coordinator tells each rank besides its items: whether only it holds them all
    (its own per-rank state), which makes them candidates for inlining into the metadata."""

    private_only: bool = False
    mode: str | None = None  # the save mode it was planned for (a cached plan may outlive a config)


class Writer(CheckpointLocation, StorageWriter, AsyncStager):
    """Save a DCP checkpoint to any fsspec URL.

    ``dcp.async_save`` first calls ``stage()`` (torch's ``AsyncStager`` protocol, when no
    ``async_stager`` is given): the state is copied into host buffers this process reuses across
    saves (``staging.py``). Then DCP calls it in this order (torch's ``StorageWriter`` protocol):

    0. (all ranks) ``reset(checkpoint_id)``: the location of this save; nothing of the last one is kept.
    1. (all ranks) ``set_up_storage_writer()``: this rank's number and whether it coordinates; the save's
       landing (``landing.py``: the durable URL, or a node's fast tier with a drain behind it).
    2. (all ranks) ``prepare_local_plan()``: record everything this rank holds, before torch deduplicates.
    3. (coordinator) ``prepare_global_plan()``: refuse or plan an overwrite (the landing), then decide
       who writes what (``planning.py``).
    4. (all ranks) ``write_data()``: against the incremental base if any (``incremental.py``), the
       landing stores this rank's items in a data file named afresh for every save (``data_file.py``);
       its objects are reported for the cross-rank check (``consistency.py``).
    5. (coordinator) ``finish()``: check the object reports, build the metadata (``save_metadata.py``),
       then the landing commits it.

    Without a coordinator (``dcp.save(..., use_collectives=False)``) every rank decides alone what it
    writes and commits its own fragment (``fragments.py``), through the same landing.

    Example::

        dcp.save(state, storage_writer=ckptio.Writer("s3://bucket/run/step-100",
                                                     ckptio.WriterConfig(mode="replica_group")))
    """

    _role = ("Writer", "dcp.save")
    _synchronize_after_execute = False  # stage() returns once the copy is made

    def __init__(
        self,
        checkpoint_id: str | os.PathLike | None = None,
        config: WriterConfig | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool | None = None,
    ):
        super().__init__()
        config = config if config is not None else WriterConfig()
        if overwrite is not None:  # torch's FileSystemWriter(path, overwrite=...) keyword
            config = dataclasses.replace(config, overwrite=overwrite)
        self.config = config
        self.storage_options = dict(storage_options or {})
        self.checkpoint_id: str | None = None
        self.rank = 0
        self.is_coordinator = True
        self._ticket: ordering.Ticket | None = None
        self._take_ticket()  # in the caller's thread: its place in this process's order of saves
        self.reset(checkpoint_id)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled by torch's PROCESS executor, on the thread that hands this save to its background
        # process: that thread takes this save's turn (ordering.py).
        if self._ticket is not None and not self._ticket.started.is_set():
            ordering.begin(self._ticket, sending_to_process=True)
        if getattr(self, "_staged_checkpointable", False):
            raise CheckpointError(
                f"dcp.async_save of {self.checkpoint_id} with the PROCESS executor: the state holds torch "
                "CheckpointableTensors, whose global shape and offsets torch's shared-memory hand-over to the "
                "background process drops (every rank's shard would look like one tensor). Save them with "
                "async_checkpointer_type=AsyncCheckpointerType.THREAD, or with dcp.save"
            )
        state = dict(self.__dict__)
        state["_ticket"] = None
        return state

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The state's host copy for ``dcp.async_save``: into the process's reused buffers (see
        ``WriterConfig.reuse_staging_buffers``), or fresh memory."""
        if self._ticket is None or self._ticket.started.is_set():  # this Writer saved before
            self._take_ticket()
        ordering.await_previous_start(self._ticket)
        user = ordering.claim(self._ticket)
        self._staged_checkpointable = staging.holds_checkpointable(state_dict)
        if not self.config.reuse_staging_buffers:
            return staging.stage_fresh(state_dict)
        return staging.writer_stager().stage_for(state_dict, user)

    def _take_ticket(self) -> None:
        """A new place in this process's order of saves; freeing this Writer unused gives it up."""
        self._ticket = ordering.take()
        weakref.finalize(self, ordering.abandon, self._ticket)

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """Nothing to release: the staging buffers are the process's (``ckptio.release_staging_buffers``)."""

    @property
    def storage_config(self) -> StorageConfig:
        return self.config.storage_config

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        # storage_options survive reset: torch's FsspecWriter drops them here and silently
        # falls back to the default endpoint.
        if checkpoint_id is not None:
            self.checkpoint_id = os.fspath(checkpoint_id)
        self._store = None
        self._held: dict[MetadataIndex, WriteItem] | None = None  # stored key -> item; set in step 2, used in 4
        self._superseded: list[str] = []  # set in step 3, used in step 5 (coordinator)
        self._save_id: str | None = None  # set in step 4
        self._fragment: fragments.FragmentSave | None = None  # set in step 1 when the save has no coordinator
        self._base: Base | None = None  # set in step 4: what an incremental save references

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self._started_unix = time.time()
        rank = kwargs.get("rank")
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.rank = rank
        self._fragment = None
        # First this save's turn: a refusal after it lets the next save of the process go on at once.
        self._ticket = ordering.begin(self._ticket)  # waits for this process's previous save to return
        self.config.validate()  # again: a field set after the config was made must meet the same rules
        self._landing = landing_for(self)  # where its bytes land and how it commits
        if kwargs.get("use_collectives", True) is False:
            self._fragment = fragments.fragment_of_save(self)
        self._landing.start()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self._save_id) if self.checkpoint_id else None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Keys are stored canonical (no _orig_mod. / _checkpoint_wrapped_module.), as ckptio.save does.
        held = canonical_write_items(plan.items)
        if plan.usable:  # a plan torch's plan cache skipped is empty: write_data finds the held items then
            self._held = held
        items = [it if idx is it.index else dataclasses.replace(it, index=idx) for idx, it in held.items()]
        return dataclasses.replace(plan, items=items, storage_data=Holdings(tuple(items), self.checkpoint_id))

    @paused_gc()
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        store = self._open_store()
        store.check_save_target()  # each rank that plans (the coordinator, or every rank without one) refuses alike
        settle(store.url)  # this process's merge of an earlier save there is called off
        if self._fragment is not None:  # every rank, with its own plan alone
            if self.is_coordinator:
                self._landing.clear_for_fragments()
            return plans
        check_same_location(plans)
        self._superseded = self._landing.check_target()
        assigned = assign_writers(plans, self.config.mode)
        return [
            dataclasses.replace(plan, items=a.items, storage_data=RankAssignment(a.private_only, self.config.mode))
            for plan, a in zip(plans, assigned, strict=True)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # A fresh name on every save, even when DCP reuses a cached plan: an overwrite must never
        # touch the files of the checkpoint it replaces before the new one commits.
        self._save_id = uuid.uuid4().hex[:16]
        file = data_file_name(self._save_id, self.rank, spread=self.config.key_prefix == "hash")
        held = self._held if self._held is not None else canonical_write_items(cached_save_plan_items(planner))
        if self._fragment is not None:
            return _done(fragments.write_own_part(self, file, held, planner))
        planned_mode = getattr(plan.storage_data, "mode", None)
        if planned_mode not in (None, self.config.mode) and self.rank == 0:
            log.warning(
                "ckptio: this save reuses a plan torch's plan cache kept from a save in mode %r, so it writes as "
                "%r did, not as the configured %r. To switch modes, save with a planner without "
                "enable_plan_caching (or of another class) once",
                planned_mode,
                planned_mode,
                self.config.mode,
            )
        assigned = {it.index: held.get(it.index, it) for it in plan.items}  # stored key -> item as the planner knows it
        # Every object this rank holds is pickled once: to compare it with the other ranks' values
        # under the same key, and (if this rank writes it) to store it.
        objects = pickled_objects(held, planner)
        report = ObjectReport(
            self.rank, value_digests(held, planner, objects), mesh=MeshRecord.of(getattr(planner, "state_dict", None))
        )
        extras = own_copies(held, assigned, self.config.differing_objects)
        private = isinstance(plan.storage_data, RankAssignment) and plan.storage_data.private_only
        inline_limit = self.config.tuning.inline_limit if private and not extras else 0
        if assigned or extras or self.is_coordinator:  # what this rank writes against; the chain's record
            self._base = self.incremental_base()
        replicas = {k: v for k, v in held.items() if k not in assigned and k not in extras}
        stored = self._landing.write(file, {**assigned, **extras}, replicas, planner, objects, inline_limit)
        note_saved(self.checkpoint_id)
        self._landing.written(stored)
        report.full_copy = self._landing.full_copy
        if self.config.differing_objects == "keep_per_rank":
            report.copies = {idx.fqn: rec for idx, rec in stored.items() if rec.kind == ItemKind.BYTES}
        results = [WriteResult(it.index, stored[it.index].stored_bytes, stored[it.index]) for it in plan.items]
        return _done(attach_report(results, report))

    @paused_gc()
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._finish(metadata, results)
        finally:
            self._landing.finished()

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._fragment is not None:
            fragments.commit_fragment(self, metadata, results[0])
            metadata.storage_meta = self.storage_meta()
            return
        results, reports = split_reports(results)
        metadata.planner_data = canonical_planner_data(metadata.planner_data)
        document, header, writers = self._document(metadata, results, reports)
        full = None
        if header.chain is not None and any(r.full_copy for r in reports):  # a base still draining: the same
            # save made from the ranks' full copies instead, should that base not arrive (``tiers/rebase.py``)
            replaced = with_records(results, [r.full_copy for r in reports])
            full_document, full_header, full_writers = self._document(metadata, replaced, reports, rebased=True)
            full = (full_document, full_header.files, full_writers)
        if header.chain is not None:  # before the commit, tiered too: deletes keep what a drain will need
            pending_s = self._landing.pending_s  # a tiered save's: its drain checks the files before it commits
            mark_references(
                self._open_store(), header.files, self._save_id, pending_s=pending_s, checked_later=bool(pending_s)
            )
        self._landing.commit(document, header, writers, self._superseded, full)
        metadata.storage_meta = self.storage_meta()

    def _document(
        self, metadata: Metadata, results: list, reports: list, rebased: bool = False
    ) -> tuple[bytes, Header, dict[str, int]]:
        """The metadata document of ``results`` (every rank's), its header and each data file's writing rank.
        (``rebased``: made full where it referenced a base still draining; what it still references, a rank
        referenced in a committed base, ends its chain: the next save against it is a full one.)"""
        per_rank = per_rank_values(reports, self.config.differing_objects)
        items, files, writers = written(results, reports)
        mesh = next((r.mesh for r in reports if r.mesh), None)
        header = header_of(self.config, metadata, files, writers, mesh, self._save_id, world_size=len(results))
        siblings = sorted(by_sibling(files))
        if siblings and rebased:
            chain = chain_of(self._base, self.config, items.values())
            chain = dataclasses.replace(chain, base=siblings[-1], depth=self.config.tuning.incremental_max_depth)
            header = dataclasses.replace(header, chain=chain)
        elif siblings:
            header = dataclasses.replace(header, chain=chain_of(self._base, self.config, items.values()))
        document = encode_metadata(metadata, items, header, per_rank)
        refuse_unloadable(document, self._open_store().describe(METADATA_NAME))
        return document, header, writers

    def incremental_base(self) -> Base | None:
        """The checkpoint this save references (``incremental.resolve_base``), or ``None``."""
        return resolve_base(
            self.checkpoint_id, self.config, lambda url: open_store(url, self.storage_options, self.storage_config)
        )


def _done(results: list[WriteResult]) -> Future[list[WriteResult]]:
    future: Future[list[WriteResult]] = Future()
    future.set_result(results)
    return future
