"""A tiered save's fast-tier part: each rank's copy of everything it holds, and its drain jobs.

A rank writes one fast-tier file: the items it was assigned for the durable tier first (so the
file's first bytes *are* its durable data file, uploaded as they are), then the items it holds
that other ranks write (replicas, so that the node restarts from its own copy), then its held
index (``held_index.py``); all fsync'd before the save goes on. When the fast tier is full (ENOSPC,
a quota, a file-size limit) the rank writes its durable items straight to the durable tier, with one
warning, and the save goes on.

An incremental save (one with a base on the durable tier) writes two files: its durable data file,
which holds only the blocks that changed against the base (what the drain uploads), and a *full copy*
of everything else the rank holds (the items it references in the base, whole, and its replicas), so
that a restart from the node reads no chain and nothing from the durable tier.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
from typing import Any, Iterable

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem

from ckptio.config import WriterConfig
from ckptio.errors import CheckpointExistsError
from ckptio.format.names import METADATA_NAME, SIBLING_PREFIX, data_file_name, parse_data_file_name
from ckptio.format.records import Header, Reference, StoredItem
from ckptio.loading.fragment_set import fragments_in
from ckptio.saving.commit import exists_error, stale_fragment
from ckptio.saving.data_file import encode_items, item_bytes
from ckptio.saving.incremental import Base
from ckptio.storage import FsspecStore
from ckptio.tiers.drain import (
    AwaitCommit,
    Commit,
    CommitFragment,
    Durable,
    Prune,
    Upload,
    drain_queue,
    durable_segments,
    references_of,
)
from ckptio.tiers.held_index import HeldIndex, held_items
from ckptio.tiers.node_notes import node_step, note_begun, step_folder, superseded
from ckptio.tiers.paths import HELD_SUFFIX, local_run_path, local_step_path, split_step
from ckptio.tiers.rebase import FullCopy, Rebase

log = logging.getLogger(__name__)

#: What a full fast tier raises: no space, a quota, a file-size limit.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def tier_full(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@functools.lru_cache(maxsize=8)
def _warn_full(where: str) -> None:
    log.warning(
        "ckptio: the fast tier %s is full; this save goes straight to the durable tier (free space there, or "
        "lower local_tier_keep)",
        where,
    )


def write_rank_copy(
    local: FsspecStore,
    file: str,
    durable_items: dict[MetadataIndex, WriteItem],
    replicas: dict[MetadataIndex, WriteItem],
    planner: SavePlanner,
    objects: dict[MetadataIndex, memoryview],
    config: WriterConfig,
    inline_limit: int,
    base: Base | None = None,
) -> tuple[dict[MetadataIndex, StoredItem], int, FullCopy | None] | None:
    """Write this rank's fast-tier files and indexes; the records of the durable items, how many of
    ``file``'s first bytes are its durable data file, and (a base still draining) where the items that
    reference it lie whole (``rebase.FullCopy``); or ``None`` when the fast tier is full (nothing of this
    save is left on it). With a ``base``, the durable items reference it where unchanged. Each file's
    index lists every item it holds (``HeldIndex.of``)."""
    names = [file, file + HELD_SUFFIX]
    inline_limit = inline_limit if not replicas else 0
    try:
        local.prepare_directory()
        if base is None:
            items = itertools.chain(item_bytes(durable_items, planner, objects), item_bytes(replicas, planner, objects))
            stored = encode_items(local, file, items, config, inline_limit)
            if not any(record.file for record in stored.values()):  # all inline in the metadata
                return stored, 0, None
            index = HeldIndex.of(file, stored, set(durable_items))
            local.put_atomic(file + HELD_SUFFIX, index.encode())
            return {k: stored[k] for k in durable_items}, index.durable_bytes, None
        stored = encode_items(local, file, item_bytes(durable_items, planner, objects), config, inline_limit, base)
        nbytes = local.size(file) if any(_in_file(record, file) for record in stored.values()) else 0
        if nbytes:
            listed = held_items({k: r for k, r in stored.items() if r.file == file})
            local.put_atomic(file + HELD_SUFFIX, HeldIndex(file, nbytes, nbytes, listed).encode())
        referenced = {k: durable_items[k] for k, record in stored.items() if _references_base(record)}
        full = full_copy_name(file)
        names += [full, full + HELD_SUFFIX]
        kept: dict[MetadataIndex, StoredItem] = {}
        if referenced or replicas:
            extras = itertools.chain(item_bytes(referenced, planner, objects), item_bytes(replicas, planner, objects))
            kept = encode_items(local, full, extras, config, digested=False)
            local.put_atomic(full + HELD_SUFFIX, HeldIndex.of(full, kept, set()).encode())
        if not referenced or base.queued is None:
            return stored, nbytes, None
        whole = {k: kept[k] for k in referenced}  # first in the full copy: what a rebase uploads
        size = max((r.offset + r.stored_bytes for r in whole.values() if r.file), default=0)
        return stored, nbytes, FullCopy(full, size, whole)
    except Exception as exc:
        if not tier_full(exc):
            raise
        local.delete_best_effort(names)
        _warn_full(local.url)
        return None


def full_copy_name(file: str) -> str:
    """The fast-tier file an incremental save keeps beside its durable data file ``file``: the same rank's,
    named by a save id no save has (``file``'s with one more digit)."""
    parsed = parse_data_file_name(file)
    return data_file_name(parsed.save_id + "f", parsed.rank)


def _references_base(record: StoredItem) -> bool:
    return isinstance(record, Reference) and any(run.file.startswith(SIBLING_PREFIX) for run in record.extents)


def _in_file(record: StoredItem, file: str) -> bool:
    runs = record.extents if isinstance(record, Reference) else ()
    return record.file == file or any(run.file == file for run in runs)


def queue_rank_drain(
    save: str,
    durable: Durable,
    local: FsspecStore,
    file: str,
    records: Iterable[StoredItem],
    nbytes: int,
    config: WriterConfig,
    coordinator: bool,
    started: float,
    full_copy: FullCopy | None = None,
) -> Upload | None:
    """This rank's jobs: upload its durable bytes (the first ``nbytes`` of ``file``, holding the blocks
    of ``records``); a rank other than the coordinator then awaits the commit, which the coordinator's
    ``Commit`` (queued by ``queue_commit``) makes, uploading its ``full_copy`` should that commit rebase the
    save (``rebase.py``), and prunes its fast tier (``coordinator``: the coordinator, or a rank of a save
    without one, which commits its own fragment: ``commit_fragment``). ``started``: when this save began
    (unix time); refusals noted at the URL before it are an earlier save's. Returns the full copy's upload
    (the coordinator's ``Commit`` runs its own)."""
    queue = drain_queue()
    rebase = None
    if full_copy is not None and full_copy.nbytes:
        segments = durable_segments(full_copy.records.values(), full_copy.file, full_copy.nbytes)
        rebase = Upload(durable, local.path(full_copy.file), full_copy.file, segments, config.drain_bandwidth)
    named = bool(nbytes) or any(_in_file(record, file) for record in records)  # empty: all reference a base
    if named:
        upload = Upload(
            durable, local.path(file), file, durable_segments(records, file, nbytes), config.drain_bandwidth
        )
        queue.submit(save, upload, config.tuning.drain_timeout_s)
    if not coordinator and (named or rebase is not None):
        name = file if named else rebase.name  # type: ignore[union-attr]
        await_commit = AwaitCommit(durable, name, started, step_folder(local), rebase, listed=named)
        queue.submit(save, await_commit, config.tuning.drain_timeout_s)
    if not coordinator:
        queue_prune(save, durable, config)
    return rebase


def queue_commit(
    save: str,
    durable: Durable,
    document: bytes,
    header: Header,
    writers: dict[str, int],
    superseded: list[str],
    config: WriterConfig,
    node: str | None = None,
    rebase: Rebase | None = None,
) -> None:
    """The coordinator's jobs: commit ``document`` (whose ``header`` is given) once every rank's file
    is there (noted in ``node``, its node's folder of the step), or ``rebase``'s full document should its
    base not arrive, then prune its fast tier."""
    references = references_of(header)
    commit = Commit(
        durable,
        document,
        header.files,
        writers,
        superseded,
        config.overwrite,
        references,
        node,
        header.save_id,
        rebase if references is not None else None,
    )
    drain_queue().submit(save, commit, config.tuning.drain_timeout_s)
    queue_prune(save, durable, config)


def queue_prune(save: str, durable: Durable, config: WriterConfig) -> None:
    run, _ = split_step(durable.url)
    prune = Prune(
        local_run_path(config.local_tier, run, durable.storage_options),
        Durable(run, durable.storage_options, durable.storage_config),
        config.local_tier_keep,
    )
    drain_queue().submit(save, prune, config.tuning.drain_timeout_s)


def commit_locally(local: FsspecStore, document: bytes, name: str = METADATA_NAME) -> None:
    """The fast tier's copy commits on the coordinator's node (its ``ckptio.json``), or each rank's (its
    fragment); when the fast tier is full, the durable commit alone makes the checkpoint loadable."""
    try:
        local.prepare_directory()
        local.put_atomic(name, document)
    except Exception as exc:
        if not tier_full(exc):
            raise
        local.delete_best_effort([name])
        _warn_full(local.url)


def refuse_committed_fragment(
    local: FsspecStore, durable: FsspecStore, name: str, save_id: str, config: WriterConfig
) -> None:
    """Before a rank's part of a tiered save without a coordinator: a committed set on the durable tier
    (every rank's fragment of one save, as every rank sees it: ``commit.stale_fragment``), or the node's live
    copy of this checkpoint (its ``ckptio.json``, which loads would read instead of the fragments, or this
    rank's fragment ``name``: ``live_node_document``), like a committed ``ckptio.json`` there, which rank 0
    refuses before any rank writes, is replaced only with ``overwrite``; the node's
    ``ckptio.json`` then goes. A fragment of a set that never completed (a requeued job's earlier attempt)
    refuses nothing."""
    if config.overwrite:
        local.delete_best_effort([METADATA_NAME])
        return
    if durable.exists(METADATA_NAME):  # rank 0 refuses it too (``clear_for_fragments``): every rank alike
        raise exists_error(durable.describe(METADATA_NAME))
    if durable.exists(name) and stale_fragment(durable, name, save_id) is None:
        raise CheckpointExistsError(
            f"{durable.url} holds a committed checkpoint, every rank's fragment of one save "
            f"({durable.describe(name)} among them); save to a new step, or pass overwrite=True to replace it"
        )
    found = live_node_document(step_folder(local), (METADATA_NAME, name))
    if found:
        raise _node_copy_exists(found, config)


def live_node_document(folder: str, names: tuple[str, ...] | None = None) -> str | None:
    """The path of a node document of the step folder ``folder`` (of ``names``: any) that may still be the
    only copy of its checkpoint, by what this node knows (``node_notes``): not passed over by
    ``ckptio.latest``, not committed on the durable tier by its drain, no later save begun on this node, and
    readable (a document cut short is no copy of anything)."""
    step = node_step(folder)
    for name, document in sorted(step.documents.items()):
        if names is not None and name not in names:
            continue
        if document.save_id is not None and document.save_id not in step.durable and not superseded(document, [step]):
            return os.path.join(folder, name)
    return None


def refuse_live_copy(config: WriterConfig, durable_url: str, storage_options: dict[str, Any]) -> None:
    """Before a tiered save with a coordinator (on the coordinator): its node's live copy of this checkpoint
    (``live_node_document``) is replaced only with ``overwrite``."""
    if config.overwrite:
        return
    found = live_node_document(local_step_path(config.local_tier, durable_url, storage_options))
    if found:
        raise _node_copy_exists(found, config)


def _node_copy_exists(path: str, config: WriterConfig) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"this node's fast tier holds a committed copy of this checkpoint ({path}) whose upload to the durable "
        "tier did not finish, so it may be the only one: ckptio.latest(...) resumes that upload on a restart. "
        "To replace it, save with overwrite=True; to discard it, run "
        f"`ckptio gc <run URL> --local-tier {config.local_tier} --delete` once ckptio.latest has passed it over"
    )


def begin_on_node(local: FsspecStore, started_unix: float, save_id: str | None) -> None:
    """A tiered save to this step begins writing on this node: noted first (``node_notes``)."""
    try:
        local.prepare_directory()
    except OSError as exc:  # a full or unwritable fast tier: the save goes on to the durable tier
        log.debug("ckptio: cannot prepare %s: %s", local.url, exc)
        return
    note_begun(step_folder(local), started_unix, save_id)


def commit_fragment(
    save: str,
    local: FsspecStore,
    durable: Durable,
    name: str,
    document: bytes,
    files: dict[str, int],
    merge: tuple[str, int] | None,
    config: WriterConfig,
    save_id: str | None = None,
) -> None:
    """A rank's fragment of a tiered save without a coordinator: committed on the node now (where the fast
    tier has room), and on the durable tier by the drain after the rank's upload, where rank 0 then merges
    the set (``merge``: its save id and rank count) once every rank's fragment is there."""
    commit_locally(local, document, name)
    job = CommitFragment(durable, name, document, files, config.overwrite, merge, step_folder(local), save_id)
    drain_queue().submit(save, job, config.tuning.drain_timeout_s)
    queue_prune(save, durable, config)


def local_commit_exists(config: WriterConfig, durable_url: str, storage_options: dict[str, Any]) -> str | None:
    """The fast-tier ``ckptio.json`` of this checkpoint on this node, or a fragment of it (a save without a
    coordinator committed there), if one exists."""
    folder = local_step_path(config.local_tier, durable_url, storage_options)
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return None
    found = [METADATA_NAME] if METADATA_NAME in names else sorted(fragments_in(names))
    return os.path.join(folder, found[0]) if found else None
