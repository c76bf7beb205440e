"""The DCP StorageReader: validated JSON metadata, ranged block reads, checksums on every read."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import uuid
import warnings
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptio.config import StorageConfig, Tuning, nested_config
from ckptio.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotCkptioCheckpointError,
    PerRankStateError,
    remember_metadata_error,
)
from ckptio.format.document import decode_metadata
from ckptio.format.names import METADATA_NAME, TORCH_DCP_METADATA_NAME, parse_data_file_name
from ckptio.format.records import Manifest, StoredItem
from ckptio.loading.extents import byte_source, recorded_sizes
from ckptio.loading.fetch import load_jobs, prepared_jobs
from ckptio.loading.fragment_set import FragmentsFound, complete_set, merged_metadata
from ckptio.loading.read_once import DIRECT, load_group, read_once
from ckptio.loading.read_tier import reads_for
from ckptio.loading.safe_load import restore_objects_under_held_keys
from ckptio.loading.shared_reads import (
    SharedReadPlan,
    load_shared,
    needed_blocks,
    needed_bytes,
    plan_shared_reads,
    worth_sharing,
)
from ckptio.loading.sources import ByteSource, Prepared
from ckptio.state.keys import CanonicalKeyDict, canonical_index
from ckptio.storage import FsspecStore
from ckptio.storage.location import CheckpointLocation

log = logging.getLogger(__name__)


class Reader(CheckpointLocation, StorageReader):
    """Load a checkpoint written by ``ckptio.Writer`` on any world size and mesh.

    Every block read is checked against its CRC32C unless ``verify=False``. ``storage_config``
    sets read concurrency, retries and read gaps, ``tuning`` the measured internals (``config.py``; both
    with the ``CKPTIO_<FIELD>`` environment variables over the values given).
    A stored dtype loads into a tensor of another only when no value can change (``conversion.py``:
    bf16 into fp32, int32 into int64); ``allow_rounding=True`` also lets floating-point values round
    (fp32 into bf16). Truncation and wrap-around (floats into ints, narrower ints) are always refused.

    DCP calls it in this order (torch's ``StorageReader`` protocol):

    0. (all ranks) ``reset(checkpoint_id)``: the location of this load.
    1. (all ranks) ``read_metadata()``: ``ckptio.json``, on object stores and network filesystems read
       by the lowest rank of the load's process group and sent to the others (``read_once.py``), on a
       local disk read by each rank; validated (``format/versions.py``).
    2. (all ranks) ``set_up_storage_reader()``: keep the item records.
    3. (all ranks) ``prepare_local_plan()``: unchanged.
    4. (coordinator) ``prepare_global_plan()``: decide ``dedup_reads`` and, when reads are shared,
       who reads which stored bytes (``shared_reads.py``), sent to every rank in ``storage_data``.
    5. (all ranks) ``read_data()``: fetch, check and deliver this rank's items (``fetch.py``); shared
       ones in rounds, exchanged over the process group (``shared_reads.load_shared``).

    ``local_tier`` (default: ``CKPTIO_LOCAL_TIER``): the node-local path a tiered save
    (``WriterConfig.local_tier``) wrote to; each byte is then read from the nearest tier that holds a
    verified copy (``read_tier.py``, ``tiers/nearest.py``), and ``bytes_read`` tells how many bytes each
    tier served.

    Both kinds of read load from the reader as an item source (``sources.ItemSource``: ``item_for``,
    ``stored_record``, ``prepare``, ``deliver``), which ``HFReader`` implements for safetensors files.
    """

    _role = ("Reader", "dcp.load")

    def __init__(
        self,
        checkpoint_id: str | os.PathLike | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
        storage_config: StorageConfig | None = None,
        dedup_reads: bool | str = "auto",
        allow_rounding: bool = False,
        local_tier: str | os.PathLike | None = None,
        tuning: Tuning | None = None,
        dedup_round_bytes: int | None = None,
    ):
        super().__init__()
        if dedup_reads not in (True, False, "auto"):
            raise ValueError(f"dedup_reads must be True, False or 'auto', got {dedup_reads!r}")
        self.storage_options = dict(storage_options or {})
        self.verify = verify
        self.dedup_reads = dedup_reads
        self.allow_rounding = allow_rounding
        self.storage_config = nested_config(StorageConfig, storage_config, "storage_config")
        if dedup_round_bytes is not None:
            warnings.warn(
                "Reader(dedup_round_bytes=...) is now Reader(tuning=ckptio.Tuning(dedup_round_bytes=...)); "
                "the old name goes in ckptio 1.1",
                DeprecationWarning,
                stacklevel=2,
            )
            tuning = dataclasses.replace(nested_config(Tuning, tuning, "tuning"), dedup_round_bytes=dedup_round_bytes)
        self.tuning = nested_config(Tuning, tuning, "tuning")
        if local_tier is None:
            local_tier = os.environ.get("CKPTIO_LOCAL_TIER") or None
        self.local_tier = os.fspath(local_tier) if local_tier is not None else None
        #: bytes the last load read from each tier ({"local": ..., "durable": ...}) with a local tier
        self.bytes_read: dict[str, int] = {}
        self.checkpoint_id: str | None = None
        self.manifest: Manifest | None = None
        self.reset(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = os.fspath(checkpoint_id)
        self._store: FsspecStore | None = None
        self.manifest = None
        self._prefetched: Manifest | None = None
        self._tier = reads_for(self)  # where this load reads from: the URL, or the nearest tier

    # No **kwargs: torch would then retry a failed read as "rank-local metadata" and hide our error.
    def read_metadata(self, *args: Any) -> Metadata:
        """``ckptio.json``, read by one rank of the ``dcp.load`` and shared over its group (``read_once.py``)."""
        prefetched, self._prefetched = self._prefetched, None
        try:
            self.manifest = prefetched or self._read_manifest(load_group())
        except CheckpointError as exc:
            remember_metadata_error(exc)
            raise
        metadata = self.manifest.metadata
        metadata.state_dict_metadata = CanonicalKeyDict(metadata.state_dict_metadata)
        metadata.storage_meta = StorageMeta(
            checkpoint_id=self.checkpoint_id, save_id=self.manifest.header.save_id, load_id=uuid.uuid4().hex[:16]
        )
        return metadata

    def prefetch_metadata(self, process_group: Any = DIRECT) -> Manifest:
        """Read and validate the metadata now, raising ckptio errors directly (dcp.load would
        wrap them); the next ``read_metadata`` call uses it instead of reading again. Given a
        ``process_group`` (``None``: the default group), which every rank of it calls this with,
        one rank reads and the others receive the bytes."""
        self._prefetched = self._read_manifest(process_group)
        return self._prefetched

    def _read_manifest(self, group: Any) -> Manifest:
        store = self._open_store()
        raw = self._tier.metadata_bytes(lambda: read_metadata_bytes(store), group)
        if raw is not None:  # a node's copy, or the durable tier's document: named as the checkpoint's
            return decode_metadata(raw, store.describe(METADATA_NAME))
        # Where every rank reads ckptio.json itself, a rank that finds fragments instead (none committed yet, or
        # one rank's read before a merge's commit and another's after it) leaves it to the lowest rank to read,
        # and merge, for all: every rank decodes the same document.
        raw = read_once(
            lambda: read_metadata_bytes(store, merge=False),
            group,
            store.url,
            each_rank_reads=not reads_once(store),
            read_for_all=lambda: read_metadata_bytes(store),
        )
        return decode_found(raw, store)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._items: dict[MetadataIndex, StoredItem] = metadata.storage_data
        if self.manifest is not None:
            self._tier.set_up(self.manifest)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        shared = self._shared_read_plan(plans)
        if shared is None:
            return plans
        return [dataclasses.replace(plan, storage_data=shared) for plan in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not self._tier.read(plan, planner):
            self._read_direct(plan, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_direct(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        store = byte_source(self._open_store(), self.manifest)
        restore_objects_under_held_keys(planner, plan)
        shared = plan.storage_data if isinstance(plan.storage_data, SharedReadPlan) else None
        if shared is None:
            pairs = [(read_item, self.item_for(read_item)) for read_item in plan.items]
        else:
            triples, failure = [], None
            try:  # a failure here must still reach the other ranks, which wait in the exchange
                triples = [(self._stored_key(ri), ri, self.item_for(ri)) for ri in plan.items]
            except Exception as exc:  # noqa: BLE001
                failure = exc
            keys = {segment.index for segments in shared.rounds for segment in segments}
            load_shared(store, shared, [t for t in triples if t[0] in keys], self, planner, failure)
            pairs = [(ri, item) for key, ri, item in triples if key not in keys]
        self.deliver(store, self.prepare(pairs, planner, places=False), planner)

    # --- the item source (``sources.ItemSource``) that plain and shared reads load from -----------
    def file_sizes(self) -> dict[str, int]:
        return recorded_sizes(self.manifest) if self.manifest else {}

    def stored_record(self, key: MetadataIndex) -> StoredItem:
        return self._items[key]

    def item_for(self, read_item: ReadItem) -> StoredItem:
        index = self._stored_key(read_item)  # a wrapped name (torch.compile's _orig_mod.) -> canonical key
        copies = self.manifest.per_rank.get(index.fqn) if self.manifest else None
        if copies:
            return self._own_copy(index.fqn, copies)
        try:
            item = self._items[index]
        except KeyError:
            raise CheckpointError(
                f"key {read_item.storage_index.fqn!r} (chunk at {tuple(read_item.storage_index.offset or ())}) "
                f"is not stored in {self.checkpoint_id}"
            ) from None
        return self._tier.record_for(index, item)

    def prepare(self, pairs: list[tuple[ReadItem, Any]], planner: LoadPlanner, *, places: bool) -> Prepared:
        """``fetch`` jobs, their destinations resolved as delivery reaches them; with ``places``, all
        now, listing where raw stored bytes land unchanged."""
        jobs = prepared_jobs(pairs, planner, self.allow_rounding)
        if not places:
            return Prepared(jobs)
        jobs = list(jobs)
        return Prepared(jobs, [place for place in (job.placement() for job in jobs) if place is not None])

    def deliver(self, source: ByteSource, prepared: Prepared, planner: LoadPlanner) -> None:
        load_jobs(source, prepared.batch, planner, self.verify, self.file_sizes(), self.storage_config.max_concurrency)

    def _shared_read_plan(self, plans: list[LoadPlan]) -> SharedReadPlan | None:
        """Coordinator: whether the ranks share reads (``dedup_reads``), and who reads what."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if not self._tier.shares_reads:  # a tiered load: each node reads what it holds from its own fast tier
            if self.dedup_reads is True:
                _log_choice(
                    "ckptio: dedup_reads=True and local_tier: a tiered load reads from the node tiers (its own, "
                    "then other nodes' copies) instead of sharing reads of the durable tier"
                )
            return None
        if self.dedup_reads is False or world == 1 or len(plans) != world:
            if self.dedup_reads is True and world > 1:
                log.warning("ckptio: dedup_reads needs dcp.load over the default process group; reading directly")
            return None
        if self.dedup_reads == "auto":
            store = self._open_store()
            remote = store.remote
            if not remote:  # never worth it from a local disk: skip planning the needs
                return None
        needs = needed_blocks(plans, self._shareable)
        if self.dedup_reads == "auto":
            needed, distinct = needed_bytes(needs, self.stored_record)
            share = worth_sharing(remote, needed, distinct)
            _log_choice(
                f"ckptio: shared reads {'on' if share else 'off'} (dedup_reads='auto'): the {world} ranks need "
                f"{needed / max(distinct, 1):.2f}x the {distinct >> 20} MiB of distinct stored bytes they read, "
                f"from {'a remote' if remote else 'a local'} store"
            )
            if not share:
                return None
        return plan_shared_reads(needs, self.stored_record, world, self.tuning.dedup_round_bytes)

    def _stored_key(self, read_item: ReadItem) -> MetadataIndex:
        index = read_item.storage_index
        return index if index in self._items else canonical_index(index)

    def _shareable(self, read_item: ReadItem) -> tuple[MetadataIndex, StoredItem] | None:
        key = self._stored_key(read_item)
        item = self._items.get(key)
        per_rank = self.manifest.per_rank.get(key.fqn) if self.manifest else None
        if item is None or per_rank or item.inline is not None:
            return None
        return key, item

    def _own_copy(self, fqn: str, copies: dict[int, StoredItem]) -> StoredItem:
        """Objects saved with differing_objects='keep_per_rank': each rank gets the value it saved."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        saved_world = self.manifest.header.world_size
        if world != saved_world or rank not in copies:
            raise PerRankStateError(
                f"key {fqn!r} was saved with one value per rank by {saved_world} ranks; this load runs on {world} "
                f"ranks, so rank {rank} has no value of its own. Load on {saved_world} ranks, or save such state "
                "with ckptio.PerRank and choose an on_resize policy"
            )
        return copies[rank]


@functools.lru_cache(maxsize=64)
def _log_choice(message: str) -> None:
    """Log each distinct choice once per process (a job loads many times)."""
    log.info(message)


def reads_once(store: FsspecStore) -> bool:
    """Whether one rank reads the metadata for all (``read_once``): on object stores and network
    filesystems, where every rank's request counts against the server. On a local disk each rank reads
    the page-cached file itself and the ranks only agree that every read succeeded (a load's metadata
    phase on 4 gloo ranks: 9-10 ms, against 15-17 ms with the gather and the broadcast)."""
    return store.remote


def read_manifest(store: FsspecStore) -> Manifest:
    """Read and validate ``ckptio.json``, explaining precisely why a checkpoint cannot be opened."""
    return decode_found(read_metadata_bytes(store), store)


def decode_found(raw: bytes, store: FsspecStore) -> Manifest:
    """``raw`` (``read_metadata_bytes``'s) decoded; where it breaks a rule and ``store`` has no ``ckptio.json``
    (the ranks that receive the bytes cannot tell), the error says that the document is the merge of its
    fragments rather than leave the reader looking for a file that is not there."""
    try:
        return decode_metadata(raw, store.describe(METADATA_NAME))
    except CheckpointFormatError as exc:
        try:
            merged = not store.exists(METADATA_NAME)
        except (OSError, CheckpointError):  # the store cannot tell now: the error as it is
            merged = False
        if not merged:
            raise
        raise CheckpointFormatError(
            f"{exc} [{store.url} has no {METADATA_NAME}: that document is the merge of the fragments of its save "
            "without a coordinator, which together break the rule above. Load an earlier checkpoint]"
        ) from None


def read_metadata_bytes(store: FsspecStore, merge: bool = True) -> bytes:
    """``ckptio.json`` as stored, else the merge of the fragments of a save without a coordinator
    (``FragmentsFound`` instead, unless ``merge``), or the error that says why there is neither."""
    try:
        return store.read(METADATA_NAME)
    except FileNotFoundError:
        pass
    names = store.list_names()
    fragments = complete_set(store, names) if names else {}
    if not fragments:
        raise _missing_metadata_error(store, names) from None
    if not merge:
        raise FragmentsFound(f"{store.url} holds the fragments of a save without a coordinator")
    return merged_metadata(store, fragments)


def file_size_problems(store: FsspecStore, manifest: Manifest) -> dict[str, str]:
    """Data file -> what is wrong with it: missing, unreadable, or not the size the metadata records."""
    problems: dict[str, str] = {}
    for name, recorded in sorted(manifest.files.items()):
        try:
            actual = store.size(name)
        except FileNotFoundError:
            problems[name] = "data file is missing"
            continue
        except CheckpointError as exc:  # e.g. not a regular file
            problems[name] = str(exc)
            continue
        if actual != recorded:
            problems[name] = f"holds {actual} bytes, the metadata records {recorded} (truncated or rewritten)"
    return problems


def check_file_sizes(store: FsspecStore, manifest: Manifest) -> None:
    """Raise ``CorruptCheckpointError`` unless every data file holds the bytes the metadata records."""
    for name, problem in file_size_problems(store, manifest).items():
        raise CorruptCheckpointError(
            f"{store.describe(name)}: {problem}. Restore the file or load an earlier checkpoint"
        )


def _missing_metadata_error(store: FsspecStore, names: list[str] | None) -> CheckpointError:
    if names is None:
        return CheckpointNotFoundError(
            f"no checkpoint at {store.url}: the path does not exist (check the URL and bucket)"
        )
    if TORCH_DCP_METADATA_NAME in names:
        return NotCkptioCheckpointError(
            f"{store.url} holds a torch DCP checkpoint (it has '.metadata', not '{METADATA_NAME}'); load it with "
            "torch.distributed.checkpoint.FileSystemReader / FsspecReader, then save it again with ckptio.Writer"
        )
    if any(n.endswith(".safetensors") for n in names):
        return NotCkptioCheckpointError(
            f"{store.url} holds safetensors files (Hugging Face weights), not a ckptio checkpoint: load them with "
            "ckptio.HFReader"
        )
    partial = [n for n in store.list_names(nested=True) or names if parse_data_file_name(n)]
    if partial:
        saves = sorted({parse_data_file_name(n).save_id for n in partial})
        return IncompleteCheckpointError(
            f"{store.url} is incomplete: it holds {len(partial)} data file(s) of save(s) {saves} but no "
            f"'{METADATA_NAME}', so the save never committed (a rank failed or was killed first). Load an earlier "
            "checkpoint. Saving again to this path succeeds; the orphaned files are never read and may be deleted"
        )
    shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "") if names else "nothing"
    return CheckpointNotFoundError(
        f"no ckptio checkpoint at {store.url}: '{METADATA_NAME}' is missing (it holds {shown})"
    )
