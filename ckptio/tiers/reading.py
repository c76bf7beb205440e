"""A tiered load: each byte from the nearest tier holding a verified copy of the checkpoint.

The checkpoint is the one committed at the durable URL: its ``ckptio.json`` (or its merged
fragments), read by the group's lowest rank. A node's copy stands in for it only where it proves to be
that checkpoint: its data files carry the committed save id in their names (``held_index.py``), so a
node's copy of an older checkpoint at the same URL (deleted and saved again, overwritten by a job on
other nodes, a reused run folder) is never read. Only while nothing is committed at the URL (the drain
has not finished) does the metadata come from a node's fast tier: its ``ckptio.json`` (sent to the other
ranks by the lowest rank that holds it), or, saved without a coordinator, the merge of the fragments the
nodes hold between them (``node_fragments_metadata``). Data files the node holds whole, and replicas its
ranks kept, are read from the fast tier; everything else from the durable tier. Every block is checked
against its CRC32C as on any load; a fast-tier file that fails a check (or is missing or short) is
dropped and its items read again from the durable tier (``Reader.read_data``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence, TypeVar

import torch.distributed as dist

from ckptio.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError
from ckptio.format.document import merge_fragments
from ckptio.format.fragments import check_set
from ckptio.format.names import METADATA_NAME
from ckptio.loading.exchange import all_objects
from ckptio.loading.fragment_set import fragments_in
from ckptio.loading.read_once import read_on
from ckptio.storage import FsspecStore, ReadRequest
from ckptio.tiers.node_notes import NodeDocument, NodeStep, live, node_step, step_folder

T = TypeVar("T")
log = logging.getLogger(__name__)


def tiered_metadata_bytes(
    local: FsspecStore, read_durable: Callable[[], bytes], list_durable: Callable[[], dict], group: Any, direct: Any
) -> bytes:
    """The metadata committed on the durable tier, read by the lowest rank of ``group``; while nothing is
    committed there, the nodes' live copy (``node_document``), else the durable tier's error. Every rank gets
    the bytes or the error."""
    alone = group is direct or not dist.is_initialized() or dist.get_world_size(group) == 1

    def committed_or_listing() -> tuple[bytes | None, dict]:
        committed = committed_durable(read_durable)
        if committed is not None:
            return committed, {}
        try:
            return None, list_durable()
        except Exception as exc:  # noqa: BLE001 - unknown: a copy noted durable counts as deleted there
            log.warning("ckptio: cannot list %s to check the nodes' copies against it: %r", local.url, exc)
            return None, {}

    # the nodes' copies are looked at only while nothing is committed at the URL
    if alone:
        committed, present = committed_or_listing()
        if committed is not None:
            return committed
        mine = node_step(step_folder(local))
        chosen = node_document(local, [mine], present, 0, lambda value: [value], lambda fn, source: fn())
        return chosen[0] if chosen is not None else read_durable()
    committed, present = read_on(committed_or_listing, group, 0)
    if committed is not None:
        return committed
    rank = dist.get_rank(group)
    views = all_objects(node_step(step_folder(local)), group)
    chosen = node_document(
        local,
        views,
        present,
        rank,
        lambda value: all_objects(value, group),
        lambda fn, source: read_on(fn, group, source),
    )
    return chosen[0] if chosen is not None else read_on(read_durable, group, 0)


def node_document(
    local: FsspecStore,
    views: list[NodeStep],
    present: dict[str, int],
    rank: int,
    all_gather: Callable[[Any], list],
    on_rank: Callable[[Callable[[], T], int], T],
) -> tuple[bytes, int] | None:
    """A step's metadata as the nodes hold it, and the group rank that holds it (``views``: what each rank's
    node holds and noted; ``present``: what the durable tier holds of the step): the newest live
    ``ckptio.json`` (``node_notes.live``: no later save begun on any node, not deleted on the durable tier
    since its drain, not passed over by ``ckptio.latest``), else the merge of the live fragments; ``None``
    when there is none. Every rank of the group calls it with the same ``views`` and ``present``:
    ``all_gather(value)`` gives every rank's value, ``on_rank(fn, source)`` runs ``fn`` there and gives every
    rank its result or its ``CheckpointError``."""
    candidates: dict[str, tuple[NodeDocument, int]] = {}
    for holder, view in enumerate(views):
        held = view.documents.get(METADATA_NAME)
        if held is not None and held.digest not in candidates:
            candidates[held.digest] = (held, holder)
    for held, holder in sorted(candidates.values(), key=lambda c: (-c[0].created_unix, c[1])):
        if live(held, views, present):
            return on_rank(lambda: local.read(METADATA_NAME), holder), holder
    mine = views[rank].documents
    for name in sorted(name for name, held in mine.items() if held.save_id is None):
        log.warning("ckptio: the node copy %s is damaged (not a ckptio document): passed over", local.describe(name))
    fragments = [name for name, held in mine.items() if name != METADATA_NAME and live(held, views, present)]
    merged = node_fragments_metadata(local, rank, all_gather, lambda fn: on_rank(fn, 0), fragments)
    return None if merged is None else (merged, 0)


def node_fragments_metadata(
    local: FsspecStore,
    rank: int,
    all_gather: Callable[[Any], list],
    on_first_rank: Callable[[Callable[[], T]], T],
    names: list[str] | None = None,
) -> bytes | None:
    """The merge of the fragments of a tiered save without a coordinator that the ranks' fast tiers
    (``local``: the node's copy of this rank, ``rank`` of its group) hold between them, or ``None`` unless
    they form one complete set. Every rank of the group calls it: ``all_gather(value)`` gives every rank's
    value, and ``on_first_rank(fn)`` runs ``fn`` on the first rank and gives every rank its result (or its
    ``CheckpointError``). Each fragment is read by the lowest rank that holds it; the first rank merges.
    Every rank's fragments reach every rank: this runs only where a drain was cut off. ``names``: the
    fragments of this rank's node to count (default: all it holds; ``node_notes.live`` picks them)."""
    names = sorted(fragments_in(local.list_names() or [] if names is None else names))
    views = all_gather(names)
    held = fragments_in(sorted({name for view in views for name in view}))
    try:
        ranks = check_set(held, local.url) if held else 0
    except CheckpointError:
        ranks = 0
    if not ranks:
        return None
    reads = {}
    for name in names:
        if next(i for i, view in enumerate(views) if name in view) == rank:
            try:
                reads[name] = local.read(name)
            except (OSError, CheckpointError):  # gone or unreadable: the set is incomplete on every rank
                pass
    documents = {name: raw for part in all_gather(reads) for name, raw in part.items()}
    if len(documents) != ranks:
        return None
    return on_first_rank(lambda: merge_fragments(documents, ranks, local.url))


def committed_durable(read_durable: Callable[[], T]) -> T | None:
    """``read_durable()``, or ``None`` when the durable tier holds no committed checkpoint there (nothing,
    or the files of a save whose commit has not arrived: a drain under way or cut off)."""
    try:
        return read_durable()
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        return None


class TieredSource:
    """A byte source (``loading.sources.ByteSource``) reading the files named in ``local_names`` from
    the fast tier, those of ``fetched`` (ranges fetched from other nodes for this load:
    ``peers.FetchedFile``) from memory, and every other one from the durable tier, counting the bytes each serves."""

    def __init__(
        self,
        local: FsspecStore,
        durable: FsspecStore,
        local_names: set[str],
        reads_durable: bool,
        fetched: dict[str, Any] | None = None,
    ):
        self.local, self.durable, self.local_names, self.fetched = local, durable, set(local_names), fetched or {}
        self.url = durable.url
        self.remote = durable.remote and reads_durable
        self.read_gap_bytes = durable.read_gap_bytes if self.remote else local.read_gap_bytes
        self.bytes_read = {"local": 0, "peer": 0, "durable": 0}

    def _tier(self, name: str) -> str:
        if name in self.fetched:
            return "peer"
        return "local" if name in self.local_names else "durable"

    def read_into(self, requests: Sequence[ReadRequest]) -> list[int]:
        counts = [0] * len(requests)
        for i, request in enumerate(requests):
            if self._tier(request.name) == "peer":
                counts[i] = self.fetched[request.name].read_into(request)
                self.bytes_read["peer"] += counts[i]
        for tier, store in (("local", self.local), ("durable", self.durable)):
            picked = [i for i, r in enumerate(requests) if self._tier(r.name) == tier]
            if picked:
                for i, got in zip(picked, store.read_into([requests[i] for i in picked]), strict=True):
                    counts[i] = got
                    self.bytes_read[tier] += got
        return counts

    def describe(self, name: str) -> str:
        if self._tier(name) == "peer":
            return f"{self.durable.describe(name)} (as fetched from another node)"
        return self._store(name).describe(name)

    def size(self, name: str) -> int:
        return self.fetched[name].size if self._tier(name) == "peer" else self._store(name).size(name)

    def exists(self, name: str) -> bool:
        return self._tier(name) == "peer" or self._store(name).exists(name)

    def _store(self, name: str) -> FsspecStore:
        return self.local if self._tier(name) == "local" else self.durable
