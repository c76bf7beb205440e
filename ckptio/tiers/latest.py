"""``ckptio.latest``: the newest checkpoint of a run that every rank can load in full, agreed by all.

One rank lists the durable tier (one listing per job, not per rank); every rank lists its node's
fast tier. Steps are ordered by the last number in their name (``paths.step_order``). The newest
step wins that is either committed on the durable tier, or committed on some node's fast tier and
loadable now, which it is when

- every rank of a job of the saving world size holds its own saving rank's whole fast-tier copy
  (a restart on the same nodes): it loads locally, and the part of its drain the crash cut off is
  queued in the background (the lowest rank holding each missing file uploads it, the rank holding
  the metadata commits); or
- every data file of the checkpoint is on some node's fast tier (its own node's, or a partner's copy:
  ``WriterConfig.local_tier_copies``) or already uploaded, and the job has a process group: it loads
  from there (a rank fetches what its node lacks from a node that holds it, ``peers.py``), the drain
  behind it as above; or
- every data file missing from the durable tier survives on some node's fast tier: those ranks upload
  them now, the durable checkpoint commits, then every rank loads (replaced nodes read the durable
  tier).

A step whose files are lost on both tiers is passed over for the next older one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from ckptio.config import StorageConfig
from ckptio.errors import CheckpointError
from ckptio.format.document import decode_metadata
from ckptio.format.names import METADATA_NAME, own_file_names, parse_data_file_name, sibling_file_name
from ckptio.format.records import Manifest
from ckptio.loading.exchange import all_objects
from ckptio.loading.fragment_set import complete_set
from ckptio.loading.read_once import outcome, read_on, result
from ckptio.loading.together import fail_together
from ckptio.saving.references import by_sibling
from ckptio.storage import FsspecStore, open_store
from ckptio.tiers.drain import (
    AfterLoad,
    AwaitCommit,
    Commit,
    DrainError,
    Durable,
    Upload,
    drain_queue,
    durable_segments,
    hold_for_load,
    references_of,
)
from ckptio.tiers.held_index import LocalCopies, damaged_blocks, local_copies
from ckptio.tiers.node_notes import NodeStep, node_step, note_durable, note_passed_over
from ckptio.tiers.nodes import this_node
from ckptio.tiers.paths import local_run_path, normalized_url, step_order
from ckptio.tiers.reading import node_document

T = TypeVar("T")
log = logging.getLogger(__name__)

#: How long a resumed drain (background or not) may take.
RESUME_TIMEOUT_S = 3600.0


def latest(
    run_url: str | os.PathLike,
    *,
    local_tier: str | os.PathLike | None = None,
    storage_options: dict[str, Any] | None = None,
    storage_config: StorageConfig | None = None,
    process_group: Any = None,
    resume: bool = True,
) -> str | None:
    """The URL of the newest checkpoint under ``run_url`` that every rank can load in full (``None``
    if there is none). Every rank of ``process_group`` (``None``: the default group, or one process)
    calls it and gets the same answer. ``local_tier`` (default: ``CKPTIO_LOCAL_TIER``): this node's
    fast tier, which may hold newer steps than the durable tier (see the module's rules)::

        url = ckptio.latest("s3://bucket/run", local_tier="/local/nvme/ckpt")
        if url:
            dcp.load(state, storage_reader=ckptio.Reader(url, local_tier="/local/nvme/ckpt"))

    A restarting job resumes (``resume=True``): the drain of the step it names is finished or queued, and
    the newer steps it passes over are noted so on every node (a save to them again is not refused, and
    ``ckptio gc --local-tier`` removes them). ``resume=False`` only answers: nothing is uploaded, committed or
    noted (``ckptio latest`` on the command line)."""
    if local_tier is None:
        local_tier = os.environ.get("CKPTIO_LOCAL_TIER") or None
    run = normalized_url(run_url)
    options = dict(storage_options or {})
    config = storage_config if storage_config is not None else StorageConfig.from_environment()
    group = _Group(process_group)
    find_durable = functools.partial(_durable_steps, run, options, config)
    if local_tier is None:
        newest = group.one_rank(find_durable).newest
        return f"{run}/{newest}" if newest else None
    local_run = local_run_path(local_tier, run, options)
    durable, everyones = group.first_and_all(find_durable, _local_steps(local_run))
    newer = {step for view in everyones for step, held in view.items() if held.documents and durable.is_older(step)}
    for step in sorted(newer, key=step_order, reverse=True):
        views = [view.get(step, NodeStep()) for view in everyones]
        if _resume(group, run, step, views, local_run, durable, options, config, resume):
            return f"{run}/{step}"
        if resume:  # passed over, on every node alike: a save to it again is not refused, gc removes it
            note_passed_over(os.path.join(local_run, step), views[group.rank].documents.values())
    return f"{run}/{durable.newest}" if durable.newest else None


@dataclasses.dataclass
class _DurableSteps:
    """The durable tier's newest committed step of a run, and what it held of each newer step it saw."""

    newest: str | None
    listed: set[str]  # the run's step folders
    sizes: dict[str, dict[str, int]]  # step -> file -> size, of the steps newer than ``newest``

    def is_older(self, step: str) -> bool:
        """Whether ``newest`` is older than ``step`` (or there is none)."""
        return self.newest is None or step_order(step) > step_order(self.newest)

    def files_of(self, step: str) -> dict[str, int] | None:
        """What the durable tier holds of ``step`` (name -> size), as listed; ``None`` when not listed."""
        return {} if step not in self.listed else self.sizes.get(step)


def _durable_steps(run: str, options: dict[str, Any], config: StorageConfig) -> _DurableSteps:
    store = open_store(run, options, config)
    steps = store.list_names() or []
    found = _DurableSteps(None, set(steps), {})
    for step in sorted(steps, key=step_order, reverse=True):
        step_store = open_store(f"{run}/{step}", options, config)
        try:
            step_store.read(METADATA_NAME)
            found.newest = step
            return found
        except FileNotFoundError:
            pass
        except CheckpointError:
            continue
        sizes = step_store.list_sizes() or {}
        try:  # saved without a coordinator: committed once every rank's fragment is there
            if complete_set(step_store, list(sizes)):
                found.newest = step
                return found
        except CheckpointError:
            continue
        found.sizes[step] = sizes  # what a resumed drain of this step need not upload again
    return found


def _local_steps(local_run: str) -> dict[str, NodeStep]:
    """This node's fast-tier steps -> what it holds of their documents, and noted (``node_notes``)."""
    try:
        entries = [e for e in os.scandir(local_run) if e.is_dir()]
    except FileNotFoundError:
        return {}
    return {e.name: node_step(e.path) for e in entries}


def _resume(
    group: "_Group",
    run: str,
    step: str,
    views: list[NodeStep],
    local_run: str,
    durable_steps: _DurableSteps,
    options: dict[str, Any],
    config: StorageConfig,
    writes: bool = True,
) -> bool:
    """Whether ``step`` loads now; finishes or queues its drain (``writes``; else only says). Its metadata:
    the newest live ``ckptio.json`` a node holds (``views``: what each rank's node holds and noted), or (none:
    saved without a coordinator) the merge of the live fragments the nodes hold. A copy that cannot be read,
    decoded or merged is passed over, on every rank alike (each got the same bytes or the same error)."""
    local = open_store(os.path.join(local_run, step), None, config)
    durable = Durable(f"{run}/{step}", options, config)
    present = durable_steps.files_of(step)
    if present is None:
        present = group.one_rank(lambda: open_store(durable.url, options, config).list_sizes() or {})
    try:
        chosen = node_document(local, views, present, group.rank, group.all, group.one_rank)
        if chosen is None:
            return False
        document, holder = chosen
        manifest = decode_metadata(document, local.describe(METADATA_NAME))
    except CheckpointError as exc:
        log.warning("ckptio: ckptio.latest passes over %s/%s: its copy on the nodes cannot be read: %s", run, step, exc)
        return False
    copies, reports = _checked(local, manifest, group)
    missing = sorted(name for name in own_file_names(manifest.files) if present.get(name) != manifest.files[name])
    uploader = {}
    for name in missing:
        uploader[name] = next((rank for rank, (_, files) in enumerate(reports) if name in files), None)
    restarts_locally = group.size == manifest.header.world_size and all(own for own, _ in reports)
    held = {name for _, files in reports for name in files}
    not_uploaded = set(missing)
    on_the_nodes = group.on and all(name in held or name not in not_uploaded for name in own_file_names(manifest.files))
    every_file_survives = all(rank is not None for rank in uploader.values())
    if not (restarts_locally or on_the_nodes or every_file_survives):
        return False
    if not writes:
        return True
    records = manifest.records()
    mine = [
        Upload(
            durable, local.path(n), n, durable_segments(records, n, manifest.files[n], manifest.extents), resumed=True
        )
        for n in missing
        if uploader[n] == group.rank
    ]
    bases, named = _missing_bases(group, durable, manifest, local_run)
    mine += bases
    # the holder's commit checks that every referenced file is there: it waits for those any rank uploads now
    uploaded_bases = sorted({name for names in group.all(named) for name in names})
    writers = dict(manifest.header.writer_ranks)
    references = references_of(manifest.header)
    node = os.path.join(local_run, step)
    save_id = manifest.header.save_id
    commit = Commit(
        durable, document, manifest.files, writers, [], False, references, node, save_id, uploaded_bases=uploaded_bases
    )
    # Every node that holds a copy notes the commit, not the holder's alone (a restarted node may hold none):
    # once the URL is deleted, a copy on a node without the note would look live (``node_notes.deleted``).
    holds_copy = bool(views[group.rank].documents) and group.rank != holder
    if restarts_locally or on_the_nodes:  # load now (ranks fetch what their node lacks), finish the drain behind it
        hold_for_load()
        if group.rank == holder:
            mine.append(commit)
        elif holds_copy:
            mine.append(_await_resumed_commit(durable, manifest, node))
        for job in mine:
            drain_queue().submit(durable.url + "#resumed", AfterLoad(job), RESUME_TIMEOUT_S)
        return True
    deadline = time.monotonic() + RESUME_TIMEOUT_S
    try:
        group.together(lambda: [job.run(deadline) for job in mine])
        group.together(lambda: commit.run(deadline) if group.rank == holder else None)
    except DrainError as exc:  # a file refused on its way (damaged since the check): the step is passed over
        log.warning("ckptio: %s/%s cannot be finished from the fast tiers: %s", run, step, exc)
        return False
    if holds_copy:
        note_durable(node, save_id, METADATA_NAME)
    return True


def _await_resumed_commit(durable: Durable, manifest: Manifest, node: str) -> AwaitCommit:
    """Another rank's commit of a resumed drain, awaited to note it on this node: by a file only this save's
    document names (refusals noted since now end it), or, where it has none, by its creation time."""
    named = sorted(own_file_names(manifest.files))
    if named:
        return AwaitCommit(durable, named[0], time.time(), node)
    return AwaitCommit(durable, "", manifest.header.created_unix, node, listed=False)


def _missing_bases(
    group: "_Group", durable: Durable, manifest: Manifest, local_run: str
) -> tuple[list[Upload], list[str]]:
    """This rank's uploads of the base files ``manifest`` references that the durable tier lacks (a save made
    while its base drained, both cut off), and those files' names in ``manifest``: each from the node's copy
    of its base step, by the rank that wrote it, where that copy is still there (else the commit finds it
    missing and fails, naming it)."""
    run = durable.url.rsplit("/", 1)[0]
    records = manifest.records()
    uploads, uploaded = [], []
    for sibling, names in sorted(by_sibling(manifest.files).items()):
        base = dataclasses.replace(durable, url=f"{run}/{sibling}")
        present = group.one_rank(lambda base=base: base.store().list_sizes() or {})
        for name in names:
            named = sibling_file_name(sibling, name)
            path = os.path.join(local_run, sibling, name)
            size = manifest.files[named]
            if present.get(name) == size or parse_data_file_name(name).rank != group.rank:
                continue
            if os.path.exists(path) and os.path.getsize(path) >= size:
                segments = durable_segments(records, named, size, manifest.extents)
                uploads.append(Upload(base, path, name, segments, resumed=True))
                uploaded.append(named)
    return uploads, uploaded


def _checked(local: FsspecStore, manifest: Manifest, group: "_Group") -> tuple[LocalCopies, list]:
    """What this node holds of ``manifest``, each file's blocks checked against their CRC32Cs as a load
    would (a copy damaged after its save is no copy: a restart from it would fail on every rank), and each
    rank's report of its node: whether it holds its own saving rank's whole copy, and the data files held
    whole. Each node's copy of a file is checked once: by the rank its name gives, where that rank is on
    the node and holds it, else by the node's lowest rank that does; a damaged copy is dropped on its node
    alone."""
    copies = local_copies(local, manifest)
    node = this_node()
    views = group.all((node, sorted({*copies.files, *copies.sizes})))
    found = []
    for name in views[group.rank][1]:
        holders = [rank for rank, (on, view) in enumerate(views) if on == node and name in view]
        own = parse_data_file_name(name).rank
        if (own if own in holders else holders[0]) == group.rank:
            problem = damaged_blocks(local, name, manifest, copies)
            if problem:
                found.append(name)
                log.warning("ckptio: the fast-tier copy %s is damaged (%s): not a copy", local.describe(name), problem)
    everyones = group.all((group.rank in copies.complete_ranks, sorted(copies.files), found))
    damaged = {on: set() for on, _ in views}
    for (on, _), (_, _, names) in zip(views, everyones, strict=True):
        damaged[on].update(names)
    for name in damaged[node]:
        copies.drop(name)
    incomplete = {on: {parse_data_file_name(name).rank for name in names} for on, names in damaged.items()}
    reports = []
    for rank, ((on, _), (own, files, _)) in enumerate(zip(views, everyones, strict=True)):
        reports.append((own and rank not in incomplete[on], sorted(set(files) - damaged[on])))
    return copies, reports


class _Group:
    """The collectives ``latest`` needs, over a process group or within one process."""

    def __init__(self, group: Any):
        self.group = group
        self.on = dist.is_initialized() and dist.get_world_size(group) > 1
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0

    def one_rank(self, fn: Callable[[], T], source: int = 0) -> T:
        """``fn()`` on ``source``; its value or its error on every rank."""
        return read_on(fn, self.group, source) if self.on else fn()

    def first_and_all(self, fn: Callable[[], T], value: Any) -> tuple[T, list]:
        """``fn()`` on the first rank (its value, or its error raised on every rank) and every rank's
        ``value``, in one exchange."""
        if not self.on:
            return fn(), [value]
        everyones = self.all((outcome(fn) if self.rank == 0 else None, value))
        return result(everyones[0][0]), [value for _, value in everyones]

    def all(self, value: T) -> list[T]:
        if not self.on:
            return [value]
        return all_objects(value, self.group)

    def together(self, fn: Callable[[], Any]) -> None:
        """``fn()`` on every rank; if it fails on any, every rank raises."""
        failure = None
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            failure = exc
        if self.on:
            fail_together(failure, self.group, "finishing a checkpoint's drain")
        elif failure is not None:
            raise failure
