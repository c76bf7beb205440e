"""Background uploads from the fast tier to the durable tier: one thread per process, jobs in order.

A tiered save queues, on every rank that wrote durable bytes, an ``Upload`` of its file's durable
part; then on the coordinator a ``Commit`` (wait until every rank's file is on the durable tier,
then publish ``ckptio.json`` create-only, as a direct save does) and on the others an
``AwaitCommit``; last, on every rank, a ``Prune`` of the node's fast tier. Jobs run one at a time
in the order they were queued: a save made while an earlier one drains queues behind it, never
replacing it. A job failing with a storage error is retried with backoff until the save's
``drain_timeout_s``; one that still fails becomes this process's drain failure, which
``wait_for_uploads()`` and the next tiered save raise, and the rest of that save's jobs are
skipped (its durable checkpoint never commits, the previous one stays loadable, the fast-tier copy
stays until a later ``ckptio.latest`` finishes its drain).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shutil
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from ckptio import process_exit
from ckptio.config import StorageConfig
from ckptio.errors import CheckpointError, DrainError
from ckptio.format.codec import checksum
from ckptio.format.document import decode_metadata
from ckptio.format.names import METADATA_NAME, REBASE_NAME, REFUSED_SUFFIX, own_file_names
from ckptio.format.records import Extent, Header, StoredItem, placed_blocks
from ckptio.saving.commit import clear_for_fragments, publish, publish_fragment
from ckptio.saving.merge_once import merge_when_complete
from ckptio.saving.references import by_sibling, mark_references, missing_references, release
from ckptio.storage import FsspecStore, LocalStore, open_store
from ckptio.tiers import lag
from ckptio.tiers.background import drain_storage_options
from ckptio.tiers.held_index import holds_committed
from ckptio.tiers.jobs import DrainQueue
from ckptio.tiers.node_notes import note_durable
from ckptio.tiers.paths import step_order
from ckptio.tiers.rebase import Rebase, asked_to_upload

log = logging.getLogger(__name__)

#: Bytes read from the fast tier per write to the durable sink (fresh memory each: an S3 sink sends
#: pieces from where they are, so at most a part and the parts in flight are held at once).
UPLOAD_PIECE_BYTES = 8 << 20
#: Waits between polls of the durable tier (a commit waiting for other ranks' files): doubling.
POLL_FIRST_S, POLL_MAX_S = 0.05, 2.0
#: A rank awaiting the commit looks for refused files (one listing) every this many polls: the first within
#: a second of its wait, then every 8 s (polls at ``POLL_MAX_S``).
REFUSAL_LISTING_EVERY = 4
#: Nodes' clocks may differ this much (NTP keeps them within milliseconds): a refusal noted up to this long
#: before a save began counts as its own. One noted within it by the save before (saves less than this
#: apart) makes the awaiting ranks raise a DrainError while the coordinator still commits: nothing is lost.
REFUSAL_CLOCK_SKEW_S = 0.5


@dataclasses.dataclass(frozen=True)
class Durable:
    """The durable checkpoint a job works on."""

    url: str
    storage_options: dict[str, Any]
    storage_config: StorageConfig

    def store(self) -> FsspecStore:
        """The durable store, on the drain's own (lower priority) event loop where it has one."""
        return open_store(self.url, drain_storage_options(self.url, self.storage_options), self.storage_config)


@dataclasses.dataclass
class Upload:
    """Copy the first bytes of the fast-tier file ``path`` to the durable file ``name``: the runs of
    ``segments``, ``(length, CRC32C)`` each (a block of the save's records; ``None``: bytes between
    blocks, unchecked). Every block is checked against its record on the way, so a file damaged
    after the save never reaches the durable tier (and its commit): the drain fails instead."""

    durable: Durable
    path: str
    name: str
    segments: tuple[tuple[int, int | None], ...]
    bandwidth: int | None = None
    resumed: bool = False  # by ckptio.latest: an earlier drain may have left a refusal of this file
    furthest: int = dataclasses.field(default=0, init=False)  # bytes sent by its furthest attempt

    @property
    def nbytes(self) -> int:
        return sum(length for length, _ in self.segments)

    def run(self, deadline: float) -> None:
        store = self.durable.store()
        store.prepare_directory()
        began = time.monotonic()
        try:
            self._copy(store, deadline)
        except DrainTooSlow:  # not the copy's fault: a later drain (ckptio.latest) may upload it as it is
            raise
        except DrainError as refusal:  # the copy is damaged: the commit waiting for this file must hear of it
            try:
                store.put_atomic(self.name + REFUSED_SUFFIX, f"{time.time():.3f}\n{refusal}".encode())
            except Exception as exc:  # noqa: BLE001 - the commit then ends at its timeout, as it did before
                log.warning("ckptio: cannot record the refusal of %s: %r", store.describe(self.name), exc)
            raise
        if self.resumed:
            store.delete_best_effort([self.name + REFUSED_SUFFIX])
        lag.uploaded(self.nbytes, time.monotonic() - began)

    def _copy(self, store: FsspecStore, deadline: float) -> None:
        pace = _Pace(self.bandwidth)
        local_durable = isinstance(store, LocalStore)
        # A POSIX durable tier gets a temporary name renamed at the end, so a file the commit finds
        # at its final name is whole; objects appear whole anyway.
        target = f"{self.name}.partial-{os.getpid()}" if local_durable else self.name
        sink = store.open_sink(target)
        try:
            with open(self.path, "rb", buffering=0) as f:
                done = 0
                for run in _runs(self.segments, UPLOAD_PIECE_BYTES):
                    piece = memoryview(bytearray(sum(length for length, _ in run)))
                    got = f.readinto(piece)
                    if got != len(piece):
                        raise DrainError(
                            f"the fast-tier file {self.path} ended at byte {done + got}, before the {self.nbytes} "
                            f"bytes of {store.describe(self.name)}: it was truncated after the save"
                        )
                    at = 0
                    for length, expected in run:
                        block = piece[at : at + length]
                        crc = checksum(block)
                        if expected is not None and crc != expected:
                            raise DrainError(
                                f"the fast-tier file {self.path} changed after the save: the block at byte {done + at} "
                                f"of {store.describe(self.name)} fails its CRC32C, so this save is not uploaded (the "
                                "durable tier keeps its previous checkpoint; check the node's disk)"
                            )
                        sink.write(block, crc)
                        at += length
                    done += got
                    if done > self.furthest:  # a retry sending the same bytes again is no progress
                        self.furthest = done
                        process_exit.progress()
                    pace.after(got, deadline, store.describe(self.name))
            sink.close()
        except BaseException:
            sink.abort()
            raise
        if local_durable:
            store.rename(target, self.name)


def durable_segments(
    records: Iterable[StoredItem], file: str, nbytes: int, extents: dict[str, tuple[Extent, ...]] | None = None
) -> tuple[tuple[int, int | None], ...]:
    """``(length, CRC32C)`` of the runs that make up the first ``nbytes`` of ``file``: each block the
    records place there (``records.placed_blocks``), and any bytes between blocks (``None``: nothing to
    check them against)."""
    blocks = placed_blocks(records, file, extents)
    segments: list[tuple[int, int | None]] = []
    at = 0
    for offset, length, crc in [*blocks, (nbytes, 0, None)]:
        if offset < at:
            raise CheckpointError(
                f"internal error: the blocks of {file} overlap or pass its durable part ({nbytes} bytes) at byte "
                f"{offset}; please report this (the save's fast-tier copy is kept)"
            )
        for gap in range(at, offset, UPLOAD_PIECE_BYTES):  # unchecked bytes, in pieces of bounded size
            segments.append((min(UPLOAD_PIECE_BYTES, offset - gap), None))
        if length:
            segments.append((length, crc))
        at = offset + length
    return tuple(segments)


def _runs(segments: tuple[tuple[int, int | None], ...], size: int) -> Iterator[list[tuple[int, int | None]]]:
    """``segments`` in consecutive runs of about ``size`` bytes (a longer segment alone)."""
    run: list[tuple[int, int | None]] = []
    bytes_in_run = 0
    for segment in segments:
        if run and bytes_in_run + segment[0] > size:
            yield run
            run, bytes_in_run = [], 0
        run.append(segment)
        bytes_in_run += segment[0]
    if run:
        yield run


@dataclasses.dataclass
class Commit:
    """Publish ``document`` once every data file it names is on the durable tier at its size."""

    durable: Durable
    document: bytes
    files: dict[str, int]
    writers: dict[str, int]
    superseded: list[str]
    overwrite: bool
    references: str | None = None  # an incremental save's id: its bases checked (and marked again) first
    node: str | None = None  # the step's folder on this node, where the commit is noted (``node_notes``)
    save_id: str | None = None

    rebase: Rebase | None = None  # made against a base still draining: the save made full, should it not arrive
    #: referenced base files other ranks upload for this commit (a resumed drain's, ``latest._missing_bases``)
    uploaded_bases: list[str] = dataclasses.field(default_factory=list)

    def run(self, deadline: float) -> None:
        store = self.durable.store()
        wait_for_files(store, self.durable.url, self.files, self.writers, deadline)
        _wait_for_bases(store, self.durable.url, {n: self.files[n] for n in self.uploaded_bases}, deadline)
        document, files = self.document, self.files
        if self.references is not None and self.rebase is not None and missing_references(store, self.files):
            log.warning(
                "ckptio: the base of %s did not reach the durable tier; uploading its ranks' full copies instead",
                self.durable.url,
            )
            url = self.durable.url
            self.rebase.run(store, deadline, lambda f, w: wait_for_files(store, url, f, w, deadline))
            document, files = self.rebase.document, self.rebase.files
            release(store, sorted(set(by_sibling(self.files)) - set(by_sibling(files))), rank=None)
        if self.references is not None and by_sibling(files):  # (a rank may reference a committed base still)
            mark_references(store, files, self.references)
        publish(store, document, files, self.superseded, self.overwrite)
        if self.rebase is not None:
            store.delete_best_effort([REBASE_NAME])
        if self.node is not None:
            note_durable(self.node, self.save_id, METADATA_NAME)

    def gave_up(self, failure: DrainError) -> None:
        """The ranks awaiting this commit (``AwaitCommit``) end at once: a refusal of ``ckptio.json``."""
        self.durable.store().put_atomic(METADATA_NAME + REFUSED_SUFFIX, f"{time.time():.3f}\n{failure}".encode())


def wait_for_files(
    store: FsspecStore, url: str, files: dict[str, int], writers: dict[str, int], deadline: float
) -> None:
    """Wait until every own data file of ``files`` is at ``store`` at its size; a refused one (its drain
    found its copy damaged) or the deadline raises a ``DrainError`` naming the ranks (``writers``)."""
    missing: list[str] = []
    own = own_file_names(files)

    def arrived() -> bool:
        present = store.list_sizes() or {}
        refused = [n for n in own if n + REFUSED_SUFFIX in present]
        if refused:
            raise _refused(store, refused[0], writers.get(refused[0], "?"))
        missing[:] = sorted(n for n in own if present.get(n) != files[n])
        return not missing

    def late() -> DrainError:
        shown = ", ".join(f"{n} (rank {writers.get(n, '?')})" for n in missing[:8])
        return DrainError(
            f"{len(missing)} data file(s) of {url} did not reach the durable tier in time: "
            f"{shown}{' ...' if len(missing) > 8 else ''}. Those ranks' uploads failed or were cut off; "
            "their fast-tier copies are kept and ckptio.latest(...) finishes the drain on the next start"
        )

    _poll(arrived, deadline, late)


def _wait_for_bases(store: FsspecStore, url: str, files: dict[str, int], deadline: float) -> None:
    """Wait until each referenced base file of ``files`` (``../<step>/<name>``) is on the durable tier at its size."""
    missing: list[str] = []

    def arrived() -> bool:
        missing[:] = [where for where, _ in missing_references(store, files)]
        return not missing

    def late() -> DrainError:
        return DrainError(
            f"the base files {', '.join(missing[:8])} that {url} references were not uploaded in time from the "
            "nodes' copies; the step is not committed, and ckptio.latest(...) tries again on the next start"
        )

    _poll(arrived, deadline, late)


@dataclasses.dataclass
class CommitFragment:
    """Publish a rank's fragment of a save without a coordinator (after its upload, queued before it),
    then, on the save's rank 0, merge the set once every rank's is there (``merge``: save id, ranks). Rank
    0's first clears a ``ckptio.json`` it overwrites: the durable tier keeps its checkpoint until then."""

    durable: Durable
    name: str
    document: bytes
    files: dict[str, int]
    overwrite: bool
    merge: tuple[str, int] | None = None
    node: str | None = None  # the step's folder on this node, where the commit is noted (``node_notes``)
    save_id: str | None = None

    def run(self, deadline: float) -> None:
        store = self.durable.store()
        if self.merge is not None and self.overwrite:
            clear_for_fragments(store, overwrite=True)
        publish_fragment(store, self.name, self.document, self.files, self.overwrite)
        if self.node is not None:
            note_durable(self.node, self.save_id, self.name)
        if self.merge is not None:
            durable = self.durable
            merge_when_complete(durable.url, durable.storage_options, durable.storage_config, *self.merge)


def references_of(header: Header) -> str | None:
    """``Commit.references`` of a checkpoint's commit: its save id where it references siblings."""
    return header.save_id if header.chain is not None and by_sibling(header.files) else None


@dataclasses.dataclass
class AwaitCommit:
    """Wait until the durable checkpoint naming this rank's file ``name`` has committed."""

    durable: Durable
    name: str
    since: float = 0.0  # when this save began (unix time): older refusals there are of earlier saves
    node: str | None = None  # the step's folder on this node, where the commit is noted (``node_notes``)
    rebase: Upload | None = None  # this rank's full copy, uploaded if the commit asks (``tiers/rebase.py``)
    listed: bool = True  # the document names ``name``; else (nothing of this rank's is new) any commit since

    def run(self, deadline: float) -> None:
        store = self.durable.store()
        misses = itertools.count(1)
        rebase = self.rebase

        def committed() -> bool:
            nonlocal rebase
            try:
                header = decode_metadata(store.read(METADATA_NAME), store.describe(METADATA_NAME)).header
                ours = self.name in header.files or (
                    rebase is None and self.rebase is not None and self.rebase.name in header.files
                )
                if not self.listed and not ours:
                    ours = header.created_unix >= self.since - REFUSAL_CLOCK_SKEW_S
                if ours and self.node is not None:
                    note_durable(self.node, header.save_id, METADATA_NAME)
                if ours:
                    return True
            except FileNotFoundError:
                pass
            if rebase is not None and asked_to_upload(store, rebase.name):
                rebase.run(deadline)
                rebase = None
            if next(misses) % REFUSAL_LISTING_EVERY == 0:  # a refused file of this save: the commit will not come
                for note in [n for n in store.list_names(nested=True) or [] if n.endswith(REFUSED_SUFFIX)]:
                    refused_at, _ = _refusal(store, note)
                    if refused_at >= self.since - REFUSAL_CLOCK_SKEW_S:
                        raise _refused(store, note[: -len(REFUSED_SUFFIX)], "?")
            return False

        _poll(
            committed,
            deadline,
            lambda: DrainError(
                f"{store.describe(METADATA_NAME)} was not committed in time after this rank uploaded {self.name}: "
                "the coordinator's drain failed or was cut off (see its log); the fast-tier copies are kept"
            ),
        )


def _refusal(store: FsspecStore, note: str) -> tuple[float, str]:
    """When a refusal note was written (unix time; 0 if unreadable) and why."""
    try:
        stamp, _, why = store.read(note).decode(errors="replace").partition("\n")
        return float(stamp), why
    except (FileNotFoundError, CheckpointError, ValueError):
        return 0.0, "its fast-tier copy failed a check"


def _refused(store: FsspecStore, name: str, rank: Any) -> DrainError:
    _, why = _refusal(store, name + REFUSED_SUFFIX)
    if name == METADATA_NAME:
        return DrainError(f"the coordinator's drain gave up committing {store.describe(name)}: {why}")
    return DrainError(
        f"{store.describe(name)} (rank {rank}) was refused by its drain, so this save does not commit on the "
        f"durable tier (it keeps its previous checkpoint): {why}"
    )


def _poll(done: Callable[[], bool], deadline: float, late: Callable[[], DrainError]) -> None:
    """Ask ``done()`` with doubling waits until it is true; raise ``late()`` when the next wait would
    pass ``deadline``."""
    wait = POLL_FIRST_S
    while not done():
        if time.monotonic() + wait > deadline or process_exit.ended():
            raise late()
        time.sleep(wait)
        wait = min(wait * 2, POLL_MAX_S)


@dataclasses.dataclass
class Prune:
    """Keep a run's ``keep`` newest fast-tier checkpoints, and every one the durable tier does not hold:
    an older step's copy goes once the checkpoint committed at its URL is that copy, or superseded it
    (``held_index.holds_committed``); a copy of another save there (one whose drain has not committed)
    stays."""

    local_run: str
    durable_run: Durable
    keep: int
    runs_after_failure = True  # an earlier job of its save failed: the node is still tidied

    def run(self, deadline: float) -> None:
        try:
            steps = sorted((e.name for e in os.scandir(self.local_run) if e.is_dir()), key=step_order)
        except FileNotFoundError:
            return
        for step in steps[: -self.keep]:
            durable = dataclasses.replace(self.durable_run, url=f"{self.durable_run.url}/{step}").store()
            try:
                committed = decode_metadata(durable.read(METADATA_NAME), durable.describe(METADATA_NAME))
            except (FileNotFoundError, CheckpointError):
                continue  # not (yet) durable: kept
            local_step = os.path.join(self.local_run, step)
            if holds_committed(local_step, committed) is None:
                continue  # another save than the one committed there, maybe newer: kept
            shutil.rmtree(local_step, ignore_errors=True)
            log.info("ckptio: removed the fast-tier copy of %s (committed on the durable tier)", durable.url)


#: A drain ``ckptio.latest`` resumed behind a restart's load waits for that load to end (the job's
#: critical path: a drain beside it takes cores and the S3 server's time from it), at most this long.
RESUME_HOLD_S = 30.0
_load_ended = threading.Event()
_load_ended.set()


@dataclasses.dataclass
class AfterLoad:
    """``job``, once the restart's load that ``ckptio.latest`` queued it behind has ended (``load_ended``),
    someone waits for the uploads, or ``RESUME_HOLD_S`` have passed."""

    job: Any

    def run(self, deadline: float) -> None:
        _load_ended.wait(max(0.0, min(RESUME_HOLD_S, deadline - time.monotonic())))
        self.job.run(deadline)

    def gave_up(self, failure: DrainError) -> None:
        gave_up = getattr(self.job, "gave_up", None)
        if gave_up is not None:
            gave_up(failure)


def hold_for_load() -> None:
    """Jobs queued as ``AfterLoad`` from now wait for the next ``load_ended``."""
    _load_ended.clear()


def load_ended() -> None:
    _load_ended.set()


class DrainTooSlow(DrainError):
    """An upload that cannot finish in its time at its bandwidth: its copy is whole, only late."""


class _Pace:
    """At most ``rate`` bytes per second, on average since the first byte; never a wait past the job's
    deadline (the upload fails instead: a drain that cannot finish in time must not hold a process)."""

    def __init__(self, rate: int | None):
        self.rate, self.start, self.sent = rate, time.monotonic(), 0

    def after(self, nbytes: int, deadline: float, what: str) -> None:
        if self.rate is None:
            return
        self.sent += nbytes
        ahead = self.sent / self.rate - (time.monotonic() - self.start)
        if ahead > 0 and time.monotonic() + ahead > deadline:
            raise DrainTooSlow(
                f"the upload of {what} at drain_bandwidth {self.rate} B/s cannot finish within drain_timeout_s; "
                "its fast-tier copy is kept (raise drain_bandwidth or drain_timeout_s)"
            )
        if ahead > 0:
            time.sleep(ahead)


_QUEUE = DrainQueue()


def drain_queue() -> DrainQueue:
    return _QUEUE


def wait_for_uploads(timeout: float | None = None) -> None:
    """Block until this process's background uploads (tiered saves, ``WriterConfig.local_tier``)
    have committed on the durable tier; raise ``DrainError`` if one failed (its fast-tier copy is
    kept, and the durable tier still holds its previous checkpoint)::

        dcp.save(state, storage_writer=ckptio.Writer("s3://bucket/run/step-200", cfg))
        ckptio.wait_for_uploads()

    It waits as well for the merges of this process's saves without a coordinator (``merge_once``) and
    for its copies to partner nodes (``WriterConfig.local_tier_copies``)."""
    from ckptio.saving.merge_once import wait_for_merges
    from ckptio.tiers.replication import wait_for_copies

    load_ended()  # a resumed drain held for a restart's load goes now: someone waits for it
    try:
        _QUEUE.wait(timeout)
        wait_for_merges(timeout)
    finally:  # copies to partner nodes are done even when an upload failed: the step may restart from them
        wait_for_copies(timeout)


def uploads_pending() -> int:
    """How many background upload jobs of this process are queued or running (0: every tiered save
    so far has committed on the durable tier, or failed, which ``wait_for_uploads`` raises). Lets a
    training loop check on the drain without blocking."""
    return _QUEUE.pending


process_exit.background_work("background uploads", lambda: _QUEUE.pending, load_ended)
