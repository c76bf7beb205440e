"""Incremental saves (``WriterConfig.incremental_from``): the checkpoint a save is made against, and for
each item which of its blocks that checkpoint's stored bytes already hold.

Rules, the same on every rank (each decides alone from the same base, no collective):

- The base is ``incremental_from``: a checkpoint URL, or ``"previous"``: the last checkpoint this
  process saved with ckptio beside the new one (saves to other folders in between do not count) that is
  committed at its URL now, or a tiered save of this process whose drain is still queued ahead of this
  one's (``note_queued``: each rank references its own records of it, and the drain commits the new save
  after it; should it fail, the new save's commit makes it full from the node's full copies:
  ``tiers/rebase.py``). A tiered save whose drain failed gives way to the one before it. It must be a
  sibling (a folder beside the new checkpoint's: the ``run/step-N`` layout), committed (or so queued), and
  saved with block digests (any save with ``incremental_from`` set records them).
  A named base that is not is an error; ``"previous"`` that is not starts the chain over with a full save
  (logged).
- The chain is bounded: a save whose base is ``incremental_max_depth`` incremental saves from a full one,
  or whose base referenced less than ``incremental_min_fraction`` of its bytes, is a full save (so no
  chain grows without end, and a state that changes too much stops paying for references).
- A block may be referenced when the base stored the same key and chunk with the same dtype, shape,
  length and block size, and the xxh3-128 digest of the block's logical bytes equals the base's
  block's: the new checkpoint keeps the base's stored block (its length and CRC32C) where it lies, in
  the folder that wrote it (a base's own references are copied as they are, so loads never follow a
  chain). Blocks are compared as they are encoded (``BlockEncoder.encode``): a raw block whose CRC32C
  differs from its base block's has changed, and is hashed only at the start of a row of changes (a state
  that changed everywhere costs a few digests per item); the others are hashed and compared. Of the
  unchanged blocks, the runs a load can afford are referenced (``referenced_blocks``); the other blocks
  are written, in the base's codec (one codec reads an item; ``data_file.py``); an item of both is stored
  in pieces (format version 7's ``extents``). Anything else is written whole, in the codec this save
  chooses.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any, Callable

from ckptio.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError
from ckptio.format.codec import block_digest
from ckptio.format.names import SIBLING_PREFIX, is_sibling_name, sibling_file_name
from ckptio.format.records import (
    DIGEST_BYTES,
    NO_DIGEST,
    ChainRecord,
    Extent,
    Header,
    Manifest,
    Reference,
    StoredItem,
)
from ckptio.loading.reader import read_manifest

log = logging.getLogger(__name__)

PREVIOUS = "previous"
#: Loading an item stored in pieces costs a request per run of blocks beyond the first: a save keeps the
#: longest runs of referenced blocks whose requests cost at most this share of reading the item whole,
#: and writes the other unchanged blocks again (so a load at any depth takes at most ~1.05x a full one's;
#: the bench's sparse table, 1% of rows changed in 47% of its blocks, written whole to S3 for that).
READ_OVERHEAD = 0.05
#: The checkpoint locations of this process's last saves with ckptio, newest first
#: (``incremental_from="previous"``).
_last_saved: list[str] = []
#: How many of them are kept: a tiered save's drain is at most a few saves behind.
SAVES_REMEMBERED = 8


def note_saved(checkpoint_id: str) -> None:
    _last_saved[:] = [checkpoint_id, *(url for url in _last_saved if url != checkpoint_id)][:SAVES_REMEMBERED]
    _queued.pop(checkpoint_id, None)  # a tiered save notes its part again (``note_queued``) once written


@dataclasses.dataclass(frozen=True)
class QueuedPart:
    """A tiered save of this process whose drain has not finished, as the next save's base: this rank's
    records of it (what the rank writes again under the same assignment: DCP's plan is deterministic), its
    depth in its chain, and ``drain_state()``: ``"queued"``, ``"failed"`` or ``"done"`` (``DrainQueue.state``)
    of it and of the queued saves it references."""

    manifest: Manifest
    depth: int
    drain_state: Callable[[], str]


#: This process's tiered saves whose drain was queued: checkpoint URL -> this rank's part.
_queued: dict[str, QueuedPart] = {}


def note_queued(
    checkpoint_id: str,
    records: Mapping[Any, StoredItem],
    files: dict[str, int],
    base: "Base | None",
    drain_state: Callable[[], str],
) -> None:
    """A tiered save to ``checkpoint_id`` wrote ``records`` (this rank's durable items, against ``base``, in
    ``files``: name -> size) and queued its drain (``drain_state``): the next save may reference it before
    the drain commits it. The drain is ordered, so its upload comes first; should it fail, a dependant's
    commit rebases the dependant (``drain.Commit``)."""
    if not records or not all(record.digests is not None for record in records.values() if record.file):
        return
    files = dict(files)
    for record in records.values():
        files.update(getattr(record, "sibling_sizes", ()))
    depth = base.depth if base is not None else 0
    # Judged by its depth alone while it drains (each rank knows only its part of what it referenced).
    header = Header(files=files, chain=ChainRecord(base.name, depth, 0, 0) if base is not None else None)
    extents = {r.file: r.extents for r in records.values() if isinstance(r, Reference) and len(r.extents) > 1}
    below = base.queued if base is not None else None

    def state() -> str:
        own = drain_state()
        return "failed" if below is not None and below.drain_state() == "failed" else own

    _queued[checkpoint_id] = QueuedPart(Manifest(header, None, dict(records), extents=extents), depth, state)  # type: ignore[arg-type]
    for url in [url for url in _queued if url not in _last_saved]:  # as many as the saves remembered
        del _queued[url]


@dataclasses.dataclass
class Base:
    """The checkpoint an incremental save references: its folder name beside the new one's, its
    decoded metadata, and the new checkpoint's depth in the chain."""

    name: str
    manifest: Manifest
    depth: int
    queued: QueuedPart | None = None  # a tiered save of this process still draining (``note_queued``)
    _sizes: dict[str, int] | None = dataclasses.field(default=None, repr=False)  # file -> size, new names

    def record(self, item: Any, block_size: int) -> StoredItem | None:
        """The base's record of ``item`` (``data_file.ItemBytes``) when it stores the same kind of item (key,
        chunk, dtype, shape, length, block size) with digests in a file, else ``None``."""
        items = self.manifest.items
        # a record without building the key's others (a 0.x base has the same peek)
        peek = getattr(items, "peek", items.get)
        old = peek(item.index)
        if (
            old is None
            or old.digests is None
            or not old.file  # kept inline in the base's metadata: nothing to point at
            or old.block_size != block_size
            or old.logical_bytes != len(item.data)
            or (old.kind, old.dtype, old.shape) != (item.kind, item.dtype, item.shape)
        ):
            return None
        return old

    def references(
        self, item: Any, old: StoredItem, digests: list[bytes], request_cost: int
    ) -> tuple[list[bool], list[bytes], list[Extent]]:
        """Which blocks of ``item`` to reference where ``old``'s lie (unchanged ones, by
        ``referenced_blocks``), given the digests of its blocks up to the first one ``old`` holds too (every
        one before it changed; none if the comparison starts here); every block's digest; and where
        ``old``'s blocks lie."""
        data, size, n = item.data, old.block_size, len(old.blocks)
        head = max(0, len(digests) - 1)  # the blocks known to have changed
        digests = digests + [block_digest(data[k * size : (k + 1) * size]) for k in range(len(digests), n)]
        unchanged = [False] * head + [
            digests[k] != NO_DIGEST and digests[k] == old.digests[k * DIGEST_BYTES : (k + 1) * DIGEST_BYTES]
            for k in range(head, n)
        ]
        places = self.block_places(old)
        return referenced_blocks(unchanged, places, request_cost), digests, places

    def block_places(self, old: StoredItem) -> list[Extent]:
        """Where each stored block of ``old`` lies, named as the new checkpoint names files (``../<name>/``
        for the base's own), in order: its file (a data file, never a virtual one), offset and length."""
        runs = self.manifest.runs_of(old)
        places, run, at = [], 0, 0  # the run holding the next block, and the block's offset in it
        for length, _ in old.blocks:
            while at >= runs[run].length:
                run, at = run + 1, 0
            places.append(Extent(self._name(runs[run].file), runs[run].offset + at, length))
            at += length
        return places

    def sizes_of(self, names: Any) -> tuple[tuple[str, int], ...]:
        """``(name, size)`` of each sibling file named (as the new checkpoint names it), as recorded here."""
        if self._sizes is None:
            self._sizes = {self._name(name): size for name, size in self.manifest.header.files.items()}
        return tuple(sorted((name, self._sizes[name]) for name in set(names) if name.startswith(SIBLING_PREFIX)))

    def _name(self, file: str) -> str:
        return file if file.startswith(SIBLING_PREFIX) else sibling_file_name(self.name, file)


def referenced_blocks(unchanged: list[bool], places: list[Extent], request_cost: int) -> list[bool]:
    """Which of the ``unchanged`` blocks (stored at ``places``) an item references, when a read request
    costs as much as reading ``request_cost`` bytes: runs of them back to back in one file, each at least
    that long, longest first, as many as ``READ_OVERHEAD`` allows the item's load in more requests. (A
    wholly unchanged item keeps the base's layout, which cost its load no more there.)"""
    runs: list[list[int]] = []  # the blocks of each run
    for k, same in enumerate(unchanged):
        if not same:
            continue
        if runs and runs[-1][-1] == k - 1 and places[k - 1].precedes(places[k]):
            runs[-1].append(k)
        else:
            runs.append([k])
    stored = sum(place.length for place in places)
    allowed = int(READ_OVERHEAD * stored // request_cost) if request_cost > 0 else len(runs)
    if all(unchanged) and len(runs) - 1 <= allowed:
        return unchanged  # as the base stores it: no more requests than there
    lengths = [sum(places[k].length for k in run) for run in runs]
    worth = sorted((n, i) for i, n in enumerate(lengths) if n >= request_cost)  # saves more than it costs
    kept = [runs[i] for _, i in worth[::-1][:allowed]]
    out = [False] * len(unchanged)
    for run in kept:
        for k in run:
            out[k] = True
    return out


def folder_and_name(url: str) -> tuple[str, str]:
    """A checkpoint location's parent folder and its own name (local paths made absolute)."""
    if "://" not in url:
        url = os.path.abspath(url)
    parent, _, name = url.rstrip("/").rpartition("/")
    return parent, name


def resolve_base(checkpoint_id: str, config, open_store) -> Base | None:
    """The base of a save to ``checkpoint_id`` under ``config`` (``WriterConfig``), or ``None`` for a full
    save; ``open_store(url)`` opens a location with the save's storage options."""
    wanted = config.incremental_from
    if wanted is None:
        return None
    if wanted != PREVIOUS:
        manifest, problem, _ = _candidate(wanted, checkpoint_id, open_store)
        if problem is not None:
            raise CheckpointError(
                f"incremental_from={wanted!r} cannot be this save's base: {problem}. Name another checkpoint, or "
                "save in full (incremental_from=None) once to start a chain"
            )
        return _within_bounds(wanted, manifest, checkpoint_id, config)
    first_problem = None
    beside = [url for url in _last_saved if folder_and_name(url)[0] == folder_and_name(checkpoint_id)[0]]
    for url in beside:  # saves elsewhere in between (another run, an export) are not this run's previous
        queued = _queued.get(url)
        state = queued.drain_state() if queued is not None else "done"
        if state == "queued" and url != checkpoint_id:  # its drain is ahead of this save's: its part suffices
            return _within_bounds(url, queued.manifest, checkpoint_id, config, queued)  # type: ignore[union-attr]
        if state == "failed":
            manifest, problem, uncommitted = None, "its drain failed", True
        else:
            manifest, problem, uncommitted = _candidate(url, checkpoint_id, open_store)
        if problem is None:
            if first_problem is not None:
                log.info("ckptio: saving %s against %s: the later %s", checkpoint_id, url, first_problem)
            return _within_bounds(url, manifest, checkpoint_id, config)
        first_problem = first_problem or f"{url} is no base: {problem}"
        if not uncommitted:
            break  # only a save not (yet) committed there gives way to the one before it
    if first_problem is not None:
        log.warning("ckptio: saving %s in full: the previous checkpoint %s", checkpoint_id, first_problem)
    elif _last_saved:  # a new run's first save: nothing to reference
        log.info(
            "ckptio: saving %s in full: the previous checkpoint %s is not beside it", checkpoint_id, _last_saved[0]
        )
    return None


def _candidate(url: str, checkpoint_id: str, open_store) -> tuple[Manifest | None, str | None, bool]:
    """The metadata of ``url`` as a base of ``checkpoint_id``, or why it is none, and whether that is
    because nothing is committed there."""
    parent, name = folder_and_name(url)
    own_parent, own_name = folder_and_name(checkpoint_id)
    if parent != own_parent or not is_sibling_name(name):
        return (
            None,
            f"it is not a checkpoint in the same folder as {checkpoint_id} (an incremental checkpoint references "
            "its siblings only, as run/step-200 references run/step-100, named with letters, digits and ._=+,@-)",
            False,
        )
    if name == own_name:
        return None, "it is the checkpoint being saved", False
    try:
        manifest = read_manifest(open_store(url))
    except (CheckpointNotFoundError, IncompleteCheckpointError) as exc:
        return None, f"nothing is committed there ({exc})", True
    except CheckpointError as exc:
        return None, f"it cannot be read ({exc})", False
    if not _digested(manifest):
        return (
            None,
            f"it was saved without block digests (format version {manifest.header.format_version}; a save records "
            "them when WriterConfig.incremental_from is set)",
            False,
        )
    return manifest, None, False


def _within_bounds(
    url: str, manifest: Manifest, checkpoint_id: str, config, queued: QueuedPart | None = None
) -> Base | None:
    """``url`` as the base, unless the chain would pass ``incremental_max_depth`` or the base referenced too
    little (``incremental_min_fraction``)."""
    chain = manifest.header.chain
    depth = (chain.depth if chain is not None else 0) + 1
    if depth > config.tuning.incremental_max_depth:
        log.info("ckptio: saving %s in full: its chain reached incremental_max_depth=%d", checkpoint_id, depth - 1)
        return None
    if chain is not None and chain.referenced_bytes < config.tuning.incremental_min_fraction * chain.stored_bytes:
        log.info(
            "ckptio: saving %s in full: its base %s referenced %d of %d stored bytes (incremental_min_fraction=%g)",
            checkpoint_id,
            url,
            chain.referenced_bytes,
            chain.stored_bytes,
            config.tuning.incremental_min_fraction,
        )
        return None
    return Base(folder_and_name(url)[1], manifest, depth, queued)


def _digested(manifest: Manifest) -> bool:
    items: Mapping = manifest.items
    first = next(iter(items.values()), None) if len(items) else None
    return first is None or first.digests is not None
