"""Every setting of ckptio, with its default, in one place.

A job's decisions are the fields of ``WriterConfig``; how bytes move to and from the store is a
``StorageConfig`` (``WriterConfig.storage_config``, ``Reader(storage_config=...)``); measured internals
are a ``Tuning`` (``WriterConfig.tuning``, ``Reader(tuning=...)``), settable to test and measure.

Precedence, the same for all three and on every reader and writer, lowest to highest: the defaults
below, then the values given (as arguments or by ``WriterConfig.from_dict(...)``), then the
``CKPTIO_<FIELD>`` environment variables (``CKPTIO_MODE=replica_group``, ``CKPTIO_PART_SIZE=67108864``,
``CKPTIO_MAX_BLOCK_SIZE=65536``), so an operator can change a job's behaviour without touching its code.
Every override by the environment is logged at INFO level.

Internal constants (module-level, below) are not overridable; they are listed here so that
every bound ckptio works within is in one place.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import warnings
from typing import Any, Mapping

import torch

log = logging.getLogger(__name__)

MODES = ("all_ranks", "replica_group")
COMPRESSIONS = (None, "zstd")
#: WriterConfig.key_prefix: where data files go under the checkpoint URL.
KEY_PREFIXES = (None, "hash")
MiB = 1 << 20

#: A resharded load reads whole blocks, so a block is at most 1/BLOCKS_PER_ITEM of its item
#: (bounding the bytes read beyond the plan), but never smaller than MIN_BLOCK_SIZE (bounding
#: the metadata: one 4-byte checksum per block).
BLOCKS_PER_ITEM = 64
MIN_BLOCK_SIZE = 4 << 10
#: Stored bytes staged in memory per round of parallel reads on load (reads straight into the
#: destination tensors do not count): bounds the reader's extra memory, compressed loads included.
READ_BATCH_BYTES = 64 * MiB
#: Stored bytes one thread checks and decodes per task on load (a task per small block costs more
#: in scheduling than the block's decode).
DECODE_TASK_BYTES = 1 * MiB
#: Longest single ranged read: touching reads are merged up to it, longer ones are split, so one
#: large item still reads in parallel (ranges.plan_requests; safetensors box reads send pieces that
#: neither touch another nor exceed it as they are, box_reads._read_pieces).
MAX_REQUEST_BYTES = 32 * MiB
#: Loads: two reads of one file at most this many bytes apart become one request, the gap read and
#: dropped (ranges.plan_requests; safetensors boxes too), unless StorageConfig.read_gap_bytes says
#: otherwise. Local files: 0 (a pread costs microseconds, and nothing is read that the load does
#: not need). Remote stores: 8 MiB, the ranged GET size AWS recommends for S3; fewer requests also
#: keep thousands of ranks loading at once under S3's per-prefix request rate (503 SlowDown). On the
#: bench's resharded load (2x2 saved, 1x4 loaded, radosgw): 1 MiB 102 GETs, 1.03x the needed bytes,
#: 0.54 s; 4 MiB 49, 1.53x, 0.51 s; 8 MiB 28, 1.88x, 0.70 s (torch FsspecReader 47, 4.55x, 2.4 s).
LOCAL_READ_GAP_BYTES = 0
REMOTE_READ_GAP_BYTES = 8 * MiB
#: Incremental saves: reading this many bytes costs about what one more read request does, so an item
#: stored in pieces (``saving/incremental.py``) is worth its runs only where they are long. Remote stores
#: and network filesystems: the read gap's 8 MiB. Local files: LOCAL_REQUEST_COST_BYTES (measured: the
#: bench's sparse table, loaded at depth 4).
LOCAL_REQUEST_COST_BYTES = MiB // 4
REMOTE_REQUEST_COST_BYTES = REMOTE_READ_GAP_BYTES
#: A local data file's writeback starts after every this many bytes written (``storage/writeback.py``),
#: so its final fsync waits for the tail, not the whole file (measured: 1.3x the write+fsync bandwidth).
WRITEBACK_BYTES = 8 << 20
#: Shared reads (Reader(dedup_reads=...)): Tuning.dedup_round_bytes's default.
SHARED_READ_ROUND_BYTES = 256 * MiB
#: Shared reads: a segment at least this large travels between two ranks as a message of its own,
#: straight from and into the memory each holds it in; smaller ones travel together, copied in and
#: out (a message costs tens of microseconds; copying into fresh memory costs more than that from
#: here on).
SHARED_READ_MESSAGE_BYTES = 256 << 10
#: dedup_reads="auto" shares reads from remote stores when the ranks need at least this many times
#: the distinct bytes they read (HSDP with 2 replicas: 2.0; a resharded load: 1.0 plus the blocks
#: that straddle two ranks' shards).
SHARED_READ_MIN_REPLICATION = 1.02
#: ... and when that saves at least this many bytes of reads: below it, the exchange's fixed cost
#: (measured on a loopback S3 server: 64 MiB 2x2 loads were not faster shared, 256 MiB ones were).
SHARED_READ_MIN_SAVED_BYTES = 128 * MiB
#: Every count, size and offset read from a header (ckptio.json, safetensors) is below this: torch
#: sizes and file offsets are int64, so a larger number is a damaged or crafted header, refused where it
#: is parsed rather than failing later as an overflow that names nothing.
INT64_LIMIT = 1 << 63
#: A compressed block holds at most this many logical bytes per stored byte: zstd spends at least 4
#: bytes (a 3-byte block header and one byte of run) on each 128 KiB it decodes to. Bounds what a
#: crafted document can declare (and a loader allocate) for a few stored bytes.
ZSTD_MAX_RATIO = 32768
#: A list index in a key's path (torch's flattening map) is below the number of keys or this, whichever
#: is larger: a list of empty containers before the one holding a tensor makes an index past the key
#: count, and a loader builds a list that long (8 bytes a slot), so a hostile document must not choose it.
LIST_INDEX_LIMIT = 1 << 20
#: Largest block the format accepts (written or read): bounds what one block can make a reader allocate.
MAX_BLOCK_SIZE_LIMIT = 64 * MiB
#: Cross-rank check of plain tensors saved under one key (saving/consistency.py): tensors up to this size are
#: compared by a checksum of all their bytes, larger ones by SAMPLED_ELEMENTS evenly spaced elements.
FULL_DIGEST_BYTES = 1 * MiB
SAMPLED_ELEMENTS = 4096
#: Fragments of a save without a coordinator read at once when a load merges them (each a small GET:
#: latency-bound, not bandwidth-bound).
FRAGMENT_READS = 64


def is_block_size(value: object) -> bool:
    """The one rule on a block size, written or read: a positive multiple of 64 bytes up to
    ``MAX_BLOCK_SIZE_LIMIT`` (config, every format version's decoder)."""
    return type(value) is int and 0 < value <= MAX_BLOCK_SIZE_LIMIT and value % 64 == 0


def cpu_threads(max_concurrency: int) -> int:
    """Threads for CPU work (checksums, compression): ``max_concurrency``, but no more than this
    process may run on cores (more only switch between each other), nor than torch's own intra-op
    threads: the share of the cores this process was given (torchrun sets 1 with several processes per
    node). 4 ranks on 2 cores compressing 2 threads each saved a 200-tensor AdamW state in 0.86 s, with 1
    thread each in 0.65-0.68 s (torch's writer, one thread per rank: 0.72-0.77 s)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(max_concurrency, cores, torch.get_num_threads()))


@dataclasses.dataclass(frozen=True)
class StorageConfig:
    """How bytes move to and from the store, on saves and loads alike: ``WriterConfig.storage_config``
    and ``Reader(storage_config=...)``, one spelling of each field for both::

        ckptio.WriterConfig(storage_config=ckptio.StorageConfig(part_size=64 << 20))
        ckptio.Reader(url, storage_config=ckptio.StorageConfig(read_gap_bytes=0, max_concurrency=16))
    """

    #: Object stores: objects larger than this go up as multipart uploads of this part size.
    part_size: int = 32 * MiB
    #: Parallel requests per rank (multipart parts on write, ranged GETs on read), and threads per
    #: rank that compress, decompress and checksum blocks (at most one per core this process may use).
    max_concurrency: int = 8
    #: Attempts per request for retryable storage errors (503 SlowDown, 500, timeouts, resets).
    retry_attempts: int = 8
    #: Upper bound in seconds on the time spent retrying one request.
    retry_deadline_s: float = 120.0
    #: Loads: reads of one file at most this many bytes apart become one request, the bytes between
    #: them read and dropped. ``None``: the backend's own (LOCAL_READ_GAP_BYTES, REMOTE_READ_GAP_BYTES).
    read_gap_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.read_gap_bytes is not None and not 0 <= self.read_gap_bytes <= MAX_REQUEST_BYTES:
            raise ValueError(f"read_gap_bytes must be None or 0..{MAX_REQUEST_BYTES}, got {self.read_gap_bytes}")
        if not 5 * MiB <= self.part_size <= 4 << 30:
            raise ValueError(
                "part_size must be within 5 MiB (S3's smallest part) and 4 GiB (so that 1.25 parts, the most "
                f"one request carries, stay within S3's 5 GiB per part and per PUT), got {self.part_size}"
            )
        for name in ("max_concurrency", "retry_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @classmethod
    def from_environment(cls, **values: Any) -> "StorageConfig":
        """``values`` over the defaults, the ``CKPTIO_<FIELD>`` environment variables over both."""
        return _with_environment(cls, values)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Measured internals of saves and loads: each default was measured (the reason is beside it) and
    is what every job should use. They are settable to test and to measure, not to configure a job:
    ``WriterConfig(tuning=Tuning(max_block_size=64 << 10))``, ``Reader(url, tuning=...)``."""

    #: Largest unit of checksumming, compression and ranged reads, in bytes (a multiple of 64).
    #: Items are cut into about 64 blocks (at least 4 KiB each) up to this size, so a resharded
    #: load reads little beyond what it needs while the metadata stays small.
    max_block_size: int = 256 << 10
    #: zstd level. 1, not zstd's usual 3: on fp32 weights it was 1.8x faster here for a 2.14x
    #: instead of 2.17x ratio.
    compression_level: int = 1
    #: A rank whose only items are its own per-rank state, at most this many bytes, hands them
    #: to the coordinator to store inside ckptio.json instead of creating a tiny object (0: never).
    inline_limit: int = 64 << 10
    #: Loads with shared reads: stored bytes exchanged per round, so a rank holds at most this much
    #: received data at a time (one stored item larger than it makes a round of its own).
    dedup_round_bytes: int = SHARED_READ_ROUND_BYTES
    #: A chain of incremental saves is this many saves long at most; the next save is a full one.
    incremental_max_depth: int = 8
    #: An incremental save whose base referenced less than this share of its stored bytes is a full one.
    incremental_min_fraction: float = 0.1
    #: Background uploads: how long one may take, retries and waiting for the other ranks' uploads
    #: included, before it fails (raised by ``ckptio.wait_for_uploads()`` or the next save).
    drain_timeout_s: float = 3600.0
    #: Background uploads: a tiered save that finds this many earlier saves of its process still waiting
    #: to upload waits for the oldest to finish first (logged), so the queue, and the fast tier's copies
    #: it keeps, cannot grow without bound when the durable tier is slower than the saves. A drain a few
    #: saves behind is warned about once per run, with its rates (``tiers/lag.py``).
    drain_max_queued_saves: int = 8

    def __post_init__(self) -> None:
        if not is_block_size(self.max_block_size):
            raise ValueError(
                f"max_block_size must be a positive multiple of 64 bytes up to {MAX_BLOCK_SIZE_LIMIT}, "
                f"got {self.max_block_size}"
            )
        if not 1 <= self.compression_level <= 22:
            raise ValueError(f"compression_level must be within 1..22, got {self.compression_level}")
        if self.inline_limit < 0:
            raise ValueError(f"inline_limit must be >= 0, got {self.inline_limit}")
        if self.dedup_round_bytes < 1:
            raise ValueError(f"dedup_round_bytes must be positive, got {self.dedup_round_bytes}")
        if self.incremental_max_depth < 1:
            raise ValueError(f"incremental_max_depth must be at least 1, got {self.incremental_max_depth}")
        if not 0 <= self.incremental_min_fraction < 1:
            raise ValueError(f"incremental_min_fraction must be within [0, 1), got {self.incremental_min_fraction}")
        if not self.drain_timeout_s > 0:
            raise ValueError(f"drain_timeout_s must be positive, got {self.drain_timeout_s}")
        if self.drain_max_queued_saves < 1:
            raise ValueError(f"drain_max_queued_saves must be at least 1, got {self.drain_max_queued_saves}")

    @classmethod
    def from_environment(cls, **values: Any) -> "Tuning":
        """``values`` over the defaults, the ``CKPTIO_<FIELD>`` environment variables over both."""
        return _with_environment(cls, values)


#: Names WriterConfig had before 1.0 for fields of its nested configs: accepted (as keywords, by
#: ``from_dict``, as attributes) with a DeprecationWarning until 1.1.
MOVED_FIELDS = {
    **{f.name: "storage_config" for f in dataclasses.fields(StorageConfig)},
    **{f.name: "tuning" for f in dataclasses.fields(Tuning) if f.name != "dedup_round_bytes"},
}
_NESTED = {"storage_config": StorageConfig, "tuning": Tuning}


@dataclasses.dataclass
class WriterConfig:
    """What a job decides about how its checkpoints are written; how bytes move is ``storage_config``,
    measured internals are ``tuning``.

    Example::

        cfg = WriterConfig(mode="replica_group", compression="zstd")
        cfg = WriterConfig.from_dict({"mode": "all_ranks", "storage_config": {"part_size": 64 << 20}})
    """

    #: ``all_ranks``: every rank writes its own file, replicated data spread evenly.
    #: ``replica_group``: each replicated item is written by the lowest rank holding it,
    #: so only the first HSDP replica group writes; ranks with nothing to write create nothing.
    mode: str = "all_ranks"
    #: ``None`` or ``"zstd"``; compression is per block, and a block that does not shrink is kept raw.
    compression: str | None = None
    #: Replace a committed checkpoint; the old one stays loadable until the new one commits.
    overwrite: bool = False
    #: What to do when ranks hold different values under one non-tensor key:
    #: ``"error"`` fails the save naming the key and ranks; ``"keep_per_rank"`` stores one value per rank.
    differing_objects: str = "error"
    #: ``dcp.async_save`` without an ``async_stager``: stage into host buffers this process keeps and
    #: reuses across saves (one copy of the state's tensors while each save is awaited before the
    #: next, two at most; ``ckptio.release_staging_buffers()`` frees them). ``False``: a fresh copy
    #: per save, freed when the save is done, as torch's default stager does.
    reuse_staging_buffers: bool = True
    #: A node-local path (NVMe, ``/dev/shm``) to save to first: each rank writes everything it holds
    #: there (fsync'd) and the save returns; the checkpoint at the Writer's URL (the durable tier) is
    #: filled and committed in the background (``ckptio.wait_for_uploads()``). Each node passes its own
    #: path; ``Reader(url, local_tier=...)`` and ``ckptio.latest`` read from it first. ``None``: off.
    local_tier: str | None = None
    #: The local tier keeps this many newest checkpoints of a run, and never one whose durable copy
    #: has not committed.
    local_tier_keep: int = 2
    #: How many nodes keep each rank's fast-tier files: ``1``, its own; ``k``, its own and ``k-1`` partner
    #: nodes (the next ones by rank; ``tiers/nodes.py``), copied in the background over the save's ranks,
    #: so a restart after a node loss reads the lost node's part from a partner instead of the durable
    #: tier. Nodes are told apart by ``CKPTIO_NODE``, torchrun's ``GROUP_RANK``, or the host name.
    local_tier_copies: int = 1
    #: Background uploads to the durable tier: at most this many bytes per second per process
    #: (``None``: as fast as the store takes them).
    drain_bandwidth: int | None = None
    #: Data files under key prefixes that spread them over an object store's partitions:
    #: ``"hash"``: ``<url>/<xx>/data-....ckio``, xx two hex digits of the file name's SHA-256, so ranks
    #: writing at once reach up to 256 prefixes (S3 serves ~3,500 PUTs/s per partition; thousands of
    #: ranks in one prefix draw 503 SlowDown). Recorded in the metadata: every reader and tool finds the
    #: files, and the checkpoint is still one URL. ``None``: all files at the URL.
    key_prefix: str | None = None
    #: ``False``: ``ckptio.save`` (and the torchtitan integration) save with
    #: ``dcp.save(..., use_collectives=False)``: no coordinator, no plan gather, no rank waits for another;
    #: each rank commits a metadata fragment of its own, and the checkpoint is loadable (resharded, by
    #: any reader) once every rank's fragment of the save is there. Replicated DTensor shards are still
    #: written once, decided from their placements; objects and plain tensors by every rank holding them.
    #: A plain ``dcp.save`` decides it by its own ``use_collectives`` argument.
    use_collectives: bool = True
    #: Incremental saves: the checkpoint to save against, a URL of a sibling checkpoint (beside this one,
    #: as ``run/step-100`` is to ``run/step-200``), or ``"previous"``: the last checkpoint this process
    #: saved beside it and committed. Every block whose content (xxh3-128 digest) equals the base's stored
    #: item is referenced there instead of written; the checkpoint loads like any other, and deletes keep
    #: the data it references.
    #: Any save with this set records the digests, so the first save of a chain (nothing to reference) is
    #: a full one. ``None``: off.
    incremental_from: str | None = None
    #: How bytes move to and from the store (part size, concurrency, retries, read gaps).
    storage_config: StorageConfig = dataclasses.field(default_factory=StorageConfig)
    #: Measured internals (block size, zstd level, inline limit, incremental chain bounds, drain timeout).
    tuning: Tuning = dataclasses.field(default_factory=Tuning)

    def __post_init__(self) -> None:
        for name, value in _environment_values(type(self)).items():
            log.info("ckptio: %s=%r from the environment overrides %r", name, value, getattr(self, name))
            setattr(self, name, value)
        for name, kind in _NESTED.items():
            setattr(self, name, nested_config(kind, getattr(self, name), name))
        self.validate()

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "WriterConfig":
        """Build a config from a mapping (e.g. a ``[checkpoint]`` section of a job's TOML/YAML); the nested
        configs as mappings of their own (``{"storage_config": {"part_size": ...}}``)."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)} | set(MOVED_FIELDS)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ckptio config key(s) {unknown}; valid keys are {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def storage(self) -> StorageConfig:
        """Deprecated (goes in 1.1): ``storage_config``."""
        warnings.warn(
            "WriterConfig.storage() is now WriterConfig.storage_config; the old name goes in ckptio 1.1",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.storage_config

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown ckptio mode {self.mode!r}; valid modes are {list(MODES)}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {self.compression!r}; valid values are {list(COMPRESSIONS)}")
        if self.differing_objects not in ("error", "keep_per_rank"):
            raise ValueError(
                f"unknown differing_objects policy {self.differing_objects!r}; "
                "valid values are ['error', 'keep_per_rank']"
            )
        for name, kind in _NESTED.items():
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
            kind(**dataclasses.asdict(getattr(self, name)))  # its rules, on fields set after it was made
        if self.local_tier is not None and not isinstance(self.local_tier, str | os.PathLike):
            raise ValueError(f"local_tier must be a local path or None, got {self.local_tier!r}")
        if self.local_tier is not None and "://" in os.fspath(self.local_tier):
            raise ValueError(
                f"local_tier must be a node-local path (NVMe, /dev/shm), not a URL: {self.local_tier!r}; the "
                "durable tier is the Writer's own URL"
            )
        if self.local_tier_keep < 1:
            raise ValueError(f"local_tier_keep must be at least 1, got {self.local_tier_keep}")
        if type(self.local_tier_copies) is not int or self.local_tier_copies < 1:
            raise ValueError(f"local_tier_copies must be an integer of at least 1, got {self.local_tier_copies!r}")
        if self.local_tier_copies > 1 and self.local_tier is None:
            raise ValueError(
                f"local_tier_copies={self.local_tier_copies} copies the fast tier to partner nodes, but local_tier "
                "is not set: pass local_tier (a node-local path), or leave local_tier_copies at 1"
            )
        if self.drain_bandwidth is not None and self.drain_bandwidth < 1:
            raise ValueError(
                f"drain_bandwidth must be None or a positive number of bytes/s, got {self.drain_bandwidth}"
            )
        if self.key_prefix not in KEY_PREFIXES:
            raise ValueError(f"unknown key_prefix {self.key_prefix!r}; valid values are {list(KEY_PREFIXES)}")
        if isinstance(self.incremental_from, os.PathLike):
            self.incremental_from = os.fspath(self.incremental_from)
        if self.incremental_from is not None and not (isinstance(self.incremental_from, str) and self.incremental_from):
            raise ValueError(
                f"incremental_from must be a checkpoint URL, 'previous' or None, got {self.incremental_from!r}"
            )

    def __getattr__(self, name: str) -> Any:  # only reached for names that are not fields
        if name not in MOVED_FIELDS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        _warn_moved(name)
        return getattr(self.__dict__[MOVED_FIELDS[name]], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in MOVED_FIELDS:  # checked with the other fields when the save starts (``validate``)
            _warn_moved(name)
            nested = copy.copy(getattr(self, MOVED_FIELDS[name]))
            object.__setattr__(nested, name, value)
            name, value = MOVED_FIELDS[name], nested
        super().__setattr__(name, value)


def _accept_moved_keywords(init: Any) -> Any:
    """``WriterConfig(part_size=...)`` and the other pre-1.0 names, applied to the nested config given (or
    the default), so ``dataclasses.replace(config, part_size=...)`` works as well."""

    def __init__(self: WriterConfig, *args: Any, **values: Any) -> None:
        for name in [name for name in values if name in MOVED_FIELDS]:
            _warn_moved(name, stacklevel=3)
            group = MOVED_FIELDS[name]
            nested = nested_config(_NESTED[group], values.get(group), group)
            values[group] = dataclasses.replace(nested, **{name: values.pop(name)})
        init(self, *args, **values)

    __init__.__doc__ = init.__doc__
    return __init__


WriterConfig.__init__ = _accept_moved_keywords(WriterConfig.__init__)  # type: ignore[method-assign]


def _warn_moved(name: str, stacklevel: int = 3) -> None:
    group = MOVED_FIELDS[name]
    warnings.warn(
        f"WriterConfig.{name} is now WriterConfig.{group}.{name} (WriterConfig({group}={_NESTED[group].__name__}"
        f"({name}=...))); the old name goes in ckptio 1.1",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def nested_config(kind: type, value: Any, name: str) -> Any:
    """A nested config given as an instance, a mapping or ``None`` (the defaults), with the environment's
    ``CKPTIO_<FIELD>`` variables over it."""
    if value is None:
        value = {}
    elif isinstance(value, kind):
        value = dataclasses.asdict(value)
    elif not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a {kind.__name__} or a mapping of its fields, got {value!r}")
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown {name} key(s) {unknown}; valid keys are {sorted(known)}")
    return kind.from_environment(**value)


def _with_environment(kind: type, values: dict[str, Any]) -> Any:
    for name, value in _environment_values(kind).items():
        log.info("ckptio: %s=%r from the environment overrides %r", name, value, values.get(name))
        values[name] = value
    return kind(**values)


def _environment_values(config: type) -> dict[str, Any]:
    """The ``CKPTIO_<FIELD>`` variables set for the fields of the dataclass ``config``, parsed."""
    return {
        field.name: _parse_env(field, os.environ["CKPTIO_" + field.name.upper()])
        for field in dataclasses.fields(config)
        if "CKPTIO_" + field.name.upper() in os.environ and field.name not in ("storage_config", "tuning")
    }


def _parse_env(field: dataclasses.Field, raw: str) -> Any:
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    text = raw.strip()
    try:
        if kind == "bool":
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "str | None":
            return None if text.lower() in ("", "none") else text
        if kind == "int | None":
            return None if text.lower() in ("", "none") else int(text)
        return text
    except ValueError:
        raise ValueError(f"environment variable CKPTIO_{field.name.upper()}={raw!r} is not a valid {kind}") from None
