"""The DCP StorageWriter: plan -> encode -> store -> commit.

Each writing rank streams its items, block by block, into one data file; the coordinator
publishes ``ckptio.json`` only after every rank's file is durable, so a checkpoint is
loadable exactly when it is complete.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import os
import sys
import time
import uuid
import weakref
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptio.config import StorageConfig, WriterConfig
from ckptio.errors import CheckpointError, CheckpointExistsError, CheckpointFormatError, StorageError
from ckptio.format.document import decode_fragment, decode_metadata, encode_metadata
from ckptio.format.fragments import FragmentInfo, Replica
from ckptio.format.names import METADATA_NAME, SIBLING_PREFIX, ItemKind, data_file_name, fragment_name
from ckptio.format.records import (
    VIRTUAL_PREFIX,
    ChainRecord,
    Header,
    MeshRecord,
    Reference,
    SavedConfig,
    StoredItem,
)
from ckptio.gc_pause import paused_gc
from ckptio.saving import ordering, staging
from ckptio.saving.commit import check_target, clear_for_fragments, publish, publish_fragment
from ckptio.saving.consistency import (
    ObjectReport,
    attach_report,
    own_copies,
    per_rank_values,
    split_reports,
    value_digests,
)
from ckptio.saving.data_file import encode_items, item_bytes, pickled_objects
from ckptio.saving.fragments import fragment_metadata, fragment_save_id
from ckptio.saving.incremental import Base, note_saved, resolve_base
from ckptio.saving.merge_once import merge_when_complete, settle
from ckptio.saving.planning import Holdings, assign_writers
from ckptio.saving.references import by_sibling, mark_references
from ckptio.saving.replicas import own_writes
from ckptio.state.keys import canonical_planner_data, canonical_write_items
from ckptio.storage import FsspecStore, open_store
from ckptio.storage.location import CheckpointLocation
from ckptio.tiers import writing as tiers
from ckptio.tiers.drain import Durable, drain_queue
from ckptio.tiers.paths import local_step_store
from ckptio.torch_seam import cached_save_plan_items, enclosing_save_wrapper
from ckptio.version import __version__

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
    1. (all ranks) ``set_up_storage_writer()``: this rank's number and whether it coordinates.
    2. (all ranks) ``prepare_local_plan()``: record everything this rank holds, before torch deduplicates.
    3. (coordinator) ``prepare_global_plan()``: refuse or plan an overwrite (``commit.py``), then decide
       who writes what (``planning.py``).
    4. (all ranks) ``write_data()``: store this rank's items in a data file named afresh for every
       save (``data_file.py``), and report its objects for the cross-rank check (``consistency.py``).
    5. (coordinator) ``finish()``: check the object reports, then commit ``ckptio.json`` (``commit.py``).

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
        return self.config.storage()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        # storage_options survive reset: torch's FsspecWriter drops them here and silently
        # falls back to the default endpoint.
        if checkpoint_id is not None:
            self.checkpoint_id = os.fspath(checkpoint_id)
        self._store = None
        self._held: dict[MetadataIndex, WriteItem] | None = None  # stored key -> item; set in step 2, used in 4
        self._superseded: list[str] = []  # set in step 3, used in step 5 (coordinator)
        self._save_id: str | None = None  # set in step 4
        self._fragment: FragmentSave | None = None  # set in step 1 when the save has no coordinator
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
        if kwargs.get("use_collectives", True) is False:
            self._fragment = self._fragment_of_save()
        if self.config.local_tier:  # a failed background upload of an earlier save is raised here
            drain_queue().raise_failure()

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
        settle(self._open_store().url)  # this process's merge of an earlier save there is called off
        if self._fragment is not None:  # every rank, with its own plan alone
            if self.is_coordinator and self.config.local_tier:  # an overwrite clears it after the upload
                check_target(self._open_store(), self.config.overwrite)
            elif self.is_coordinator:
                clear_for_fragments(self._open_store(), self.config.overwrite)
            return plans
        _check_same_location(plans)
        if self.config.local_tier:
            self._superseded = self._check_tiered_target()
        else:
            self._superseded = check_target(self._open_store(), self.config.overwrite)
        if self.config.local_tier and not self.config.overwrite:
            found = tiers.local_commit_exists(self.config, self.checkpoint_id, self.storage_options)
            if found:
                raise CheckpointExistsError(
                    f"the fast tier already holds a committed copy of {self.checkpoint_id} ({found}) that has not "
                    "reached the durable tier; save to a new step, or pass overwrite=True to replace it"
                )
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
            return self._write_own_part(file, held, planner)
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
        inline_limit = self.config.inline_limit if private and not extras else 0
        stored = None
        if assigned or extras or self.is_coordinator:  # what this rank writes against; the chain's record
            self._base = self._incremental_base()
        if self.config.local_tier:
            replicas = {k: v for k, v in held.items() if k not in assigned and k not in extras}
            if assigned or extras or replicas:
                stored = self._write_tiered(file, {**assigned, **extras}, replicas, planner, objects, inline_limit)
            elif not self.is_coordinator:
                tiers.queue_prune(self._drain_key(), self._durable(), self.config)
        if stored is None and (assigned or extras):  # not tiered, or the fast tier is full
            store = self._open_store()
            store.prepare_directory()
            items = item_bytes({**assigned, **extras}, planner, objects)
            stored = encode_items(store, file, items, self.config, inline_limit, self._base)
        note_saved(self.checkpoint_id)
        stored = stored or {}
        if self.config.differing_objects == "keep_per_rank":
            report.copies = {idx.fqn: rec for idx, rec in stored.items() if rec.kind == ItemKind.BYTES}
        results = [WriteResult(it.index, stored[it.index].stored_bytes, stored[it.index]) for it in plan.items]
        future: Future[list[WriteResult]] = Future()
        future.set_result(attach_report(results, report))
        return future

    @paused_gc()
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._fragment is not None:
            self._commit_fragment(metadata, results[0])
            return
        results, reports = split_reports(results)
        per_rank = per_rank_values(reports, self.config.differing_objects)
        items, files, writers = _written(results, reports)
        mesh = next((r.mesh for r in reports if r.mesh), None)
        header = _header(self.config, metadata, files, writers, mesh, self._save_id, world_size=len(results))
        if by_sibling(files):
            header = dataclasses.replace(header, chain=_chain(self._base, self.config, items.values()))
        metadata.planner_data = canonical_planner_data(metadata.planner_data)
        document = encode_metadata(metadata, items, header, per_rank)
        refuse_unloadable(document, self._open_store().describe(METADATA_NAME))
        if header.chain is not None:  # before the commit, tiered too: deletes keep what a drain will need
            mark_references(self._open_store(), files, self._save_id, pending_s=self._drain_time())
        if self.config.local_tier:
            tiers.commit_locally(self._local_store(), document)
            tiers.queue_commit(
                self._drain_key(), self._durable(), document, header, writers, self._superseded, self.config
            )
        else:
            publish(self._open_store(), document, header.files, self._superseded, self.config.overwrite)
        metadata.storage_meta = self.storage_meta()

    # --- saves without a coordinator (``dcp.save(..., use_collectives=False)``) ------------------
    def _incremental_base(self) -> Base | None:
        return resolve_base(
            self.checkpoint_id, self.config, lambda url: open_store(url, self.storage_options, self.storage_config)
        )

    def _fragment_of_save(self) -> FragmentSave:
        """This rank's place in a save without a coordinator, or a clear refusal."""
        if not torch.distributed.is_initialized():
            return FragmentSave(fragment_save_id(self.checkpoint_id), 1)
        wrapper = enclosing_save_wrapper(sys._getframe(1))  # torch hands the writer its rank, not its group
        if wrapper is None and self.rank != torch.distributed.get_rank():
            raise CheckpointError(
                f"ckptio cannot tell the process group of this save without collectives (this rank is {self.rank} "
                f"of the save's group and {torch.distributed.get_rank()} of the default one, and torch's dcp.save "
                "frame was not found): save over the default process group"
            )
        group = getattr(wrapper, "group", None)
        members = None if group is None else tuple(torch.distributed.get_process_group_ranks(group))
        return FragmentSave(fragment_save_id(self.checkpoint_id), torch.distributed.get_world_size(group), members)

    def _write_own_part(
        self, file: str, held: dict[MetadataIndex, WriteItem], planner: SavePlanner
    ) -> Future[list[WriteResult]]:
        """Write what this rank decides alone to write (``replicas.py``): its chunks no other rank
        writes, and its own copy of every object and plain tensor."""
        state = getattr(planner, "state_dict", None) or {}
        own = own_writes(held, state, self.rank, self.config.mode, self._fragment.members)
        self._fragment.replicas = own.replicas
        self._fragment.mesh = MeshRecord.of(state)
        stored = None
        if own.written:  # against this rank's own resolve of the base (the same checkpoint on every rank)
            self._base = self._incremental_base()
        if self.config.local_tier:
            name = fragment_name(self.rank, self._fragment.ranks)
            tiers.refuse_committed_fragment(self._local_store(), self._open_store(), name, self.config)
            replicas = {k: v for k, v in held.items() if k not in own.written}
            objects = pickled_objects(held, planner)
            stored = self._write_tiered(file, own.written, replicas, planner, objects, self.config.inline_limit)
        if stored is None and own.written:  # not tiered, or the fast tier is full
            store = self._open_store()
            store.prepare_directory()
            objects = pickled_objects(own.written, planner)
            items = item_bytes(own.written, planner, objects)
            stored = encode_items(store, file, items, self.config, self.config.inline_limit, self._base)
        stored = stored or {}
        note_saved(self.checkpoint_id)
        future: Future[list[WriteResult]] = Future()
        future.set_result([WriteResult(index, record.stored_bytes, record) for index, record in stored.items()])
        return future

    def _commit_fragment(self, metadata: Metadata, results: list[WriteResult]) -> None:
        """Commit this rank's fragment (``commit.publish_fragment``); the save is loadable once every
        rank's is there."""
        save = self._fragment
        items, files, _ = _written([results], [])
        writers = {name: self.rank for name in files if not name.startswith(SIBLING_PREFIX)}  # a sibling's: its name's
        header = _header(self.config, metadata, files, writers, save.mesh, save.save_id, world_size=save.ranks)
        if by_sibling(files):  # this rank's part of the chain; the merge joins the ranks' parts
            header = dataclasses.replace(header, chain=_chain(self._base, self.config, items.values()))
        metadata.planner_data = canonical_planner_data(metadata.planner_data)
        info = FragmentInfo(save.save_id, self.rank, save.ranks, tuple(sorted(save.replicas, key=_replica_order)))
        document = encode_metadata(fragment_metadata(metadata, items), items, header, fragment=info)
        name = fragment_name(self.rank, save.ranks)
        store = self._open_store()
        refuse_unloadable(document, store.describe(name), decode_fragment)
        if header.chain is not None:
            mark_references(store, files, save.save_id, self.rank, self._drain_time())
        merge = (save.save_id, save.ranks) if self.rank == 0 else None
        if self.config.local_tier:  # on the node now; on the durable tier after this rank's upload
            tiers.commit_fragment(
                self._drain_key(), self._local_store(), self._durable(), name, document, files, merge, self.config
            )
        else:
            publish_fragment(store, name, document, files, self.config.overwrite)
            if merge is not None:
                merge_when_complete(store.url, self.storage_options, self.storage_config, *merge)
        metadata.storage_meta = self.storage_meta()

    # --- tiered saves (``WriterConfig.local_tier``, ``ckptio/tiers``) ------------------------------
    def _write_tiered(
        self,
        file: str,
        durable_items: dict[MetadataIndex, WriteItem],
        replicas: dict[MetadataIndex, WriteItem],
        planner: SavePlanner,
        objects: dict[MetadataIndex, memoryview],
        inline_limit: int,
    ) -> dict | None:
        """Write everything this rank holds to the fast tier and queue the upload of its durable part;
        the records of ``durable_items`` (their offsets are those of the durable file), or ``None``
        when the fast tier is full (the caller then writes them to the durable tier)."""
        local = self._local_store()
        written = tiers.write_rank_copy(
            local,
            file,
            durable_items,
            replicas,
            planner,
            objects,
            self.config,
            inline_limit,
            self._base,
            list_durable=self._fragment is not None,
        )
        durable = written[0] if written else None
        tiers.queue_rank_drain(
            self._drain_key(),
            self._durable(),
            local,
            file,
            (durable or {}).values(),
            written[1] if written else 0,
            self.config,
            self.is_coordinator or self._fragment is not None,  # a rank of a save without one commits its own
            self._started_unix,
        )
        return durable

    def _check_tiered_target(self) -> list[str]:
        """``check_target`` on the durable tier, which a tiered save does not need to reach: when it is
        unreachable the save goes on to the fast tier (its commit there stays create-only)."""
        try:
            return check_target(self._open_store(), self.config.overwrite)
        except StorageError as exc:
            log.warning("ckptio: cannot check the durable tier before a tiered save; saving to the fast tier: %s", exc)
            return []

    def _drain_time(self) -> float:
        """How long after the save its durable commit may come (a tiered save's drain; 0: now)."""
        return self.config.drain_timeout_s if self.config.local_tier else 0.0

    def _local_store(self) -> FsspecStore:
        return local_step_store(self.config.local_tier, self.checkpoint_id, self.storage_options, self.storage_config)

    def _durable(self) -> Durable:
        return Durable(self.checkpoint_id, dict(self.storage_options), self.storage_config)

    def _drain_key(self) -> str:
        return f"{self.checkpoint_id}#{self._save_id}"


def refuse_unloadable(document: bytes, where: str, decode: Callable[[bytes, str], Any] = decode_metadata) -> None:
    """A save that reports success must load: its metadata goes through the decoder every load uses
    before it is committed, so a rule the encoder missed fails the save, not a later restart."""
    try:
        decode(document, where)
    except CheckpointFormatError as exc:
        raise CheckpointError(
            f"this save's metadata would not load, so the save was not committed: {exc}. The state holds "
            "something ckptio cannot store; please report it with the state's key layout"
        ) from None


def _header(
    config: WriterConfig,
    metadata: Metadata,
    files: dict[str, int],
    writers: dict[str, int],
    mesh: MeshRecord | None,
    save_id: str | None,
    world_size: int,
) -> Header:
    return Header(
        files=files,
        written_by=f"ckptio {__version__}",
        torch_version=torch.__version__,
        created_unix=time.time(),
        save_id=save_id,
        world_size=world_size,
        mesh=mesh,
        config=SavedConfig(config.mode, config.compression, config.max_block_size),
        writer_ranks=writers,
        dcp_version=metadata.version,
    )


def _chain(base: Base | None, config: WriterConfig, items: Any) -> ChainRecord:
    """The chain record of an incremental save's metadata. A rank referenced a base the coordinator did
    not resolve only if the base changed during the save: the depth is then taken as the bound's, so
    the next save is a full one."""
    items = list(items)
    referenced = sum(
        run.length
        for item in items
        if isinstance(item, Reference)
        for run in item.extents
        if run.file.startswith(SIBLING_PREFIX)
    )
    stored = sum(item.stored_bytes for item in items)
    if base is None:
        log.warning("ckptio: ranks of this save resolved different incremental bases; the next save will be full")
        return ChainRecord("unknown", config.incremental_max_depth, referenced, stored)
    return ChainRecord(base.name, base.depth, referenced, stored)


def _check_same_location(plans: list[SavePlan]) -> None:
    """Every rank must save to the same checkpoint: files split across paths never load."""
    locations: dict[str | None, list[int]] = {}
    for rank, plan in enumerate(plans):
        if isinstance(plan.storage_data, Holdings):
            locations.setdefault(plan.storage_data.checkpoint_id, []).append(rank)
    if len(locations) > 1:
        shown = "; ".join(
            f"ranks {ranks[:8]}{' ...' if len(ranks) > 8 else ''}: {url!r}" for url, ranks in locations.items()
        )
        raise CheckpointError(
            f"the ranks were given different checkpoint locations ({shown}); every rank must save to the same "
            "path. Build the path once (e.g. on rank 0) and share it, instead of from a per-rank clock or value"
        )


def _written(
    results: list[list[WriteResult]], reports: list[ObjectReport]
) -> tuple[dict[tuple[str, torch.Size | None], StoredItem], dict[str, int], dict[str, int]]:
    """The record of every written item by ``(key, chunk offsets or None)``, and the size and writing
    rank of every data file (a rank's results name distinct bytes of its own file). C-level passes
    over the results: at thousands of ranks a Python loop over every result was a fifth of the finish."""
    every = list(itertools.chain.from_iterable(results))
    stored = list(map(_STORAGE_DATA, every))
    items = dict(zip(map(_INDEX_KEY, every), stored, strict=True))
    names = list(map(_FILE, stored))
    files: dict[str, int] = {}
    for name, size in zip(names, map(_STORED_BYTES, stored), strict=True):
        files[name] = files.get(name, 0) + size
    ranks = list(itertools.chain.from_iterable(map(itertools.repeat, range(len(results)), map(len, results))))
    writers = dict(zip(names, ranks, strict=True))
    if any(name.startswith((SIBLING_PREFIX, VIRTUAL_PREFIX)) for name in files):
        _count_references(stored, ranks, files, writers)
    if any(report.copies for report in reports):  # keep_per_rank: a rank's assigned objects are in both lists
        counted = {(item.file, item.offset) for item in stored}
        for report in reports:
            for item in report.copies.values():
                if (item.file, item.offset) not in counted:
                    counted.add((item.file, item.offset))
                    files[item.file] = files.get(item.file, 0) + item.stored_bytes
                    writers[item.file] = report.rank
    files.pop("", None)  # inline in ckptio.json
    writers.pop("", None)
    return items, files, writers


def _count_references(
    stored: list[StoredItem], ranks: list[int], files: dict[str, int], writers: dict[str, int]
) -> None:
    """The data files of an incremental save's references (``records.Reference``): a sibling's has the
    size recorded there and the writer its name gives; an item stored in pieces counts its own runs in
    the rank's file, and its virtual name is no file."""
    for item, rank in zip(stored, ranks, strict=True):
        if not isinstance(item, Reference):
            continue
        if item.file.startswith(VIRTUAL_PREFIX):
            files.pop(item.file, None)
            writers.pop(item.file, None)
            for run in item.extents:
                if not run.file.startswith(SIBLING_PREFIX):
                    files[run.file] = files.get(run.file, 0) + run.length
                    writers[run.file] = rank
        for name, size in item.sibling_sizes:
            files[name] = size
            writers.pop(name, None)


@dataclasses.dataclass
class FragmentSave:
    """A rank's part in a save without a coordinator: the save's id (the same on every rank), how many
    ranks save, and what ``write_data`` found for the fragment."""

    save_id: str
    ranks: int
    members: tuple[int, ...] | None = None  # the save's group: global ranks by group rank (None: every rank)
    replicas: list[Replica] = dataclasses.field(default_factory=list)
    mesh: MeshRecord | None = None


def _replica_order(replica: Replica) -> tuple:
    return (replica.fqn, replica.offsets)


_STORAGE_DATA = operator.attrgetter("storage_data")
_INDEX_KEY = operator.attrgetter("index.fqn", "index.offset")
_FILE = operator.attrgetter("file")
_STORED_BYTES = operator.attrgetter("stored_bytes")
