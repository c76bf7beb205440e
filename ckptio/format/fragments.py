"""A save without a coordinator (``dcp.save(..., use_collectives=False)``): each rank's metadata
fragment, and the one rule that merges a complete set of them into an ordinary checkpoint's metadata.

Each rank commits ``ckptio.rank-<r>-of-<n>.json`` (``names.fragment_name``): a metadata document of
the items it wrote, like ``ckptio.json``, plus a ``fragment`` field::

    "fragment": {"save_id": "9f0c...", "rank": 3, "ranks": 8,
                 "replicas": {"keys": ["model.w", ...], "offsets": [[0, 0], ...], "writers": [1, ...]}}

``save_id`` is the same on every rank of one save and differs between saves; ``replicas`` lists the
chunks this rank holds but left to another rank (``writers``), decided from the placements every
holder sees alike. The checkpoint is committed when all ``ranks`` fragments of one save are present;
``merge`` then checks the set (one save, every rank once, one rank count, every replica written by
its writer) and joins the fragments' keys, chunks, items and files. Items several ranks wrote under
one key (objects and plain tensors: no rank knows who else holds them, so every holder stores its own)
are kept once when they are equal; objects that differ are kept per rank, as
``WriterConfig(differing_objects="keep_per_rank")`` keeps them; plain tensors that differ are refused,
as a save with a coordinator refuses them.

``fragment_columns`` applies the same rule column by column to fragments of one chunk per key (what saves
at thousands of ranks write), and writes the same document. No I/O here: ``loading/fragment_set.py``
lists and reads the fragments.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any, NamedTuple

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ckptio.config import INT64_LIMIT
from ckptio.errors import CheckpointFormatError, IncompleteCheckpointError, MixedFragmentsError, PerRankStateError
from ckptio.format.names import FragmentName, dtype_name, fragment_name
from ckptio.format.records import Header, Manifest, StoredItem
from ckptio.format.rules import require_count, require_counts
from ckptio.format.stored_items import StoredItems

#: The field of a fragment document that makes it one.
FRAGMENT_FIELD = "fragment"
_SAVE_ID = re.compile("[0-9a-f]{16,64}")


class Replica(NamedTuple):
    """A chunk a rank holds and another rank writes (a tuple: a fragment at scale lists hundreds)."""

    fqn: str
    offsets: tuple[int, ...]
    writer: int


@dataclasses.dataclass(frozen=True)
class FragmentInfo:
    """A fragment's own record: which save it belongs to, whose it is, and what it left to others."""

    save_id: str
    rank: int
    ranks: int
    replicas: tuple[Replica, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "save_id": self.save_id,
            "rank": self.rank,
            "ranks": self.ranks,
            "replicas": {
                "keys": [r.fqn for r in self.replicas],
                "offsets": [list(r.offsets) for r in self.replicas],
                "writers": [r.writer for r in self.replicas],
            },
        }

    @classmethod
    def from_json(cls, doc: Any, where: str) -> "FragmentInfo":
        if not isinstance(doc, dict):
            raise CheckpointFormatError(f"{where} has no '{FRAGMENT_FIELD}' object; it is not a ckptio fragment")
        save_id = doc.get("save_id")
        if not isinstance(save_id, str) or not _SAVE_ID.fullmatch(save_id):
            raise CheckpointFormatError(
                f"{where}: the fragment's save_id must be 16-64 hex digits, got {save_id!r:.80}"
            )
        rank = require_count(doc.get("rank"), "the fragment's rank", where)
        ranks = require_count(doc.get("ranks"), "the fragment's rank count", where)
        if not rank < ranks:
            raise CheckpointFormatError(f"{where}: fragment rank {rank} is not below its rank count {ranks}")
        table = doc.get("replicas", {})
        if not isinstance(table, dict):
            raise CheckpointFormatError(f"{where}: the fragment's 'replicas' must be a JSON object")
        keys, offsets, writers = (table.get(k, []) for k in ("keys", "offsets", "writers"))
        if not (isinstance(keys, list) and isinstance(offsets, list) and isinstance(writers, list)):
            raise CheckpointFormatError(f"{where}: the fragment's replicas must be three lists")
        if not len(keys) == len(offsets) == len(writers):
            raise CheckpointFormatError(f"{where}: the fragment's replica lists differ in length")
        if _plain_replicas(keys, offsets, writers, ranks):  # checked in bulk: the usual case
            return cls(save_id, rank, ranks, tuple(map(Replica, keys, map(tuple, offsets), writers)))
        replicas = []  # which replica is wrong, and how
        for fqn, box, writer in zip(keys, offsets, writers, strict=True):
            if not isinstance(fqn, str) or not isinstance(box, list):
                raise CheckpointFormatError(f"{where}: a fragment replica is not (key, [offsets], writer)")
            writer = require_count(writer, f"the writer of replica {fqn!r:.80}", where)
            if not writer < ranks:
                raise CheckpointFormatError(f"{where}: replica {fqn!r:.80} names writer rank {writer} of {ranks}")
            replicas.append(Replica(fqn, tuple(require_counts(box, where)), writer))
        return cls(save_id, rank, ranks, tuple(replicas))


def _plain_replicas(keys: list, offsets: list, writers: list, ranks: int) -> bool:
    """Whether every replica is (a key, a list of offsets, a writer rank below ``ranks``), each offset
    and rank a non-negative integer within int64."""
    if not (set(map(type, keys)) <= {str} and set(map(type, offsets)) <= {list} and set(map(type, writers)) <= {int}):
        return False
    flat = list(itertools.chain.from_iterable(offsets))
    if not set(map(type, flat)) <= {int}:
        return False
    return (not writers or (min(writers) >= 0 and max(writers) < ranks)) and (
        not flat or (min(flat) >= 0 and max(flat) < INT64_LIMIT)
    )


@dataclasses.dataclass
class Fragment:
    """One rank's decoded fragment, and where it was read from."""

    name: str
    where: str
    manifest: Manifest
    info: FragmentInfo


def check_set(named: dict[str, FragmentName], where: str) -> int:
    """The rank count of the fragment set whose names are ``named`` (name -> its rank and count);
    ``MixedFragmentsError`` when the names claim different rank counts, ``IncompleteCheckpointError``
    naming the missing ranks when some are absent."""
    counts: dict[int, list[int]] = {}
    for parsed in named.values():
        counts.setdefault(parsed.ranks, []).append(parsed.rank)
    if len(counts) > 1:
        shown = "; ".join(f"{n} ranks: fragments of ranks {_ranks(sorted(r))}" for n, r in sorted(counts.items()))
        raise MixedFragmentsError(
            f"{where} holds fragments of saves by different numbers of ranks ({shown}): saves without a "
            "coordinator by different jobs wrote to one path. Load an earlier checkpoint, or delete this one "
            "and save again"
        )
    ((ranks, present),) = counts.items()
    if len(present) < ranks:  # a name's count is untrusted: list the first missing ranks, not all of them
        have = set(present)
        missing = list(itertools.islice((rank for rank in range(ranks) if rank not in have), 17))
        raise IncompleteCheckpointError(
            f"{where} is incomplete: a save without a coordinator by {ranks} ranks committed the fragments of "
            f"{len(present)} ranks, and ranks {_ranks(missing)} never committed theirs (failed or killed "
            "before the end of dcp.save). Load an earlier checkpoint"
        )
    return ranks


def merge(fragments: list[Fragment], where: str) -> tuple[Metadata, dict, Header, dict[str, dict[int, StoredItem]]]:
    """Join a complete set of fragments (one per rank, ``check_set`` passed) into what
    ``versions.encode_metadata`` takes: DCP metadata, item records by ``(key, offsets or None)``,
    the header, and the objects kept per rank."""
    fragments = sorted(fragments, key=lambda f: f.info.rank)
    check_one_save([(f.name, f.where, f.info) for f in fragments], where)
    state: dict[str, Any] = {}
    chunks_seen: dict[str, dict[tuple[int, ...], Any]] = {}
    planner_data: dict[str, Any] = {}
    items: dict[tuple[str, Any], StoredItem] = {}  # the first rank's copy of each item
    first_rank: dict[tuple[str, Any], int] = {}
    copies: dict[tuple[str, Any], dict[int, StoredItem]] = {}  # items more than one rank stored: every copy
    files: dict[str, int] = {}
    writers: dict[str, int] = {}
    for fragment in fragments:
        rank, manifest = fragment.info.rank, fragment.manifest
        for fqn, md in manifest.metadata.state_dict_metadata.items():
            _merge_key(state, chunks_seen, fqn, md, fragment.where)
        for fqn, path in (manifest.metadata.planner_data or {}).items():
            if planner_data.setdefault(fqn, path) != path:
                refuse_paths(fqn, path, planner_data[fqn], fragment.where)
        for key, item in _records(manifest.items):
            if key not in items:
                items[key], first_rank[key] = item, rank
            else:
                copies.setdefault(key, {first_rank[key]: items[key]})[rank] = item
        for name, size in manifest.header.files.items():
            if name in files:
                refuse_file_twice(name, writers[name], fragment.where)
            files[name] = size
            writers[name] = manifest.header.writer_ranks.get(name, rank)
    per_rank = _one_copy_each(items, copies, state, where)
    check_replicas(fragments, items, where)
    first = fragments[0].manifest.header
    header = dataclasses.replace(
        first,
        files=files,
        writer_ranks=writers,
        world_size=len(fragments),
        created_unix=max(f.manifest.header.created_unix for f in fragments),
        mesh=next((f.manifest.header.mesh for f in fragments if f.manifest.header.mesh), None),
    )
    metadata = Metadata(state_dict_metadata=state, planner_data=planner_data or None)
    if first.dcp_version is not None:
        metadata.version = first.dcp_version
    return metadata, items, header, per_rank


def _records(items: Any) -> Any:
    """``((key, offsets or None), record)`` of a fragment's items (offsets as tuples: a torch.Size is equal)."""
    if isinstance(items, StoredItems):
        return items.records()
    return (((index.fqn, index.offset), item) for index, item in items.items())


def check_one_save(fragments: list[tuple[str, str, FragmentInfo]], where: str) -> None:
    """The fragments (name, where read, record; by rank) are one save's, one per rank."""
    for expected, (name, read_from, info) in enumerate(fragments):
        if name != fragment_name(info.rank, info.ranks) or info.rank != expected:
            raise MixedFragmentsError(
                f"{read_from} says it is rank {info.rank}'s of {info.ranks}: one rank's fragment is there "
                "twice (copied or renamed). Load an earlier checkpoint"
            )
    by_save: dict[str, list[int]] = {}
    for _, _, info in fragments:
        by_save.setdefault(info.save_id, []).append(info.rank)
    if len(by_save) > 1:
        shown = "; ".join(f"save {save}: ranks {_ranks(ranks)}" for save, ranks in by_save.items())
        raise MixedFragmentsError(
            f"{where} holds fragments of {len(by_save)} different saves ({shown}): a save to this path was cut "
            "off on some ranks and another one overwrote the rest. It never loads; load an earlier checkpoint"
        )


def _merge_key(state: dict, chunks_seen: dict, fqn: str, md: Any, where: str) -> None:
    known = state.get(fqn)
    if known is None:
        if isinstance(md, TensorStorageMetadata):
            state[fqn] = TensorStorageMetadata(md.properties, md.size, list(md.chunks))
            chunks_seen[fqn] = {tuple(c.offsets): c for c in md.chunks}
        else:
            state[fqn] = md
        return
    if isinstance(md, BytesStorageMetadata) or isinstance(known, BytesStorageMetadata):
        if type(md) is not type(known):
            refuse_kinds(fqn, isinstance(md, TensorStorageMetadata), isinstance(known, TensorStorageMetadata), where)
        return
    if md.size != known.size or md.properties.dtype != known.properties.dtype:
        mine, first = dtype_name(md.properties.dtype), dtype_name(known.properties.dtype)
        refuse_shapes(fqn, (mine, md.size), (first, known.size), where)
    seen = chunks_seen[fqn]
    for chunk in md.chunks:
        other = seen.get(tuple(chunk.offsets))
        if other is None:
            seen[tuple(chunk.offsets)] = chunk
            known.chunks.append(chunk)
        elif other.sizes != chunk.sizes:
            refuse_sizes(fqn, chunk.offsets, chunk.sizes, other.sizes, where)


def refuse_kinds(fqn: str, tensor: bool, known_tensor: bool, where: str) -> None:
    kinds = {True: "a tensor", False: "an object"}
    raise MixedFragmentsError(
        f"{where} stores key {fqn!r} as {kinds[tensor]}, another fragment as {kinds[known_tensor]}"
    )


def refuse_shapes(fqn: str, dtype_and_size: tuple, known: tuple, where: str) -> None:
    (dtype, size), (known_dtype, known_size) = dtype_and_size, known
    raise MixedFragmentsError(
        f"{where} stores key {fqn!r} as {dtype} {list(size)}, another fragment as {known_dtype} {list(known_size)}: "
        "the ranks saved different states under one key"
    )


def refuse_sizes(fqn: str, offsets: Any, sizes: Any, known_sizes: Any, where: str) -> None:
    raise MixedFragmentsError(
        f"{where} stores key {fqn!r} at {list(offsets)} with sizes {list(sizes)}, another fragment with "
        f"{list(known_sizes)}"
    )


def refuse_paths(fqn: str, path: Any, known: Any, where: str) -> None:
    raise MixedFragmentsError(
        f"{where} and an earlier fragment give key {fqn!r} different paths in the state ({list(known)} and "
        f"{list(path)}); the ranks saved differently shaped states"
    )


def refuse_file_twice(name: str, first_writer: int, where: str) -> None:
    raise MixedFragmentsError(
        f"{where} and the fragment of rank {first_writer} both name data file {name}; one fragment was copied or "
        "renamed. Load an earlier checkpoint"
    )


def _one_copy_each(
    items: dict[tuple[str, Any], StoredItem],
    copies: dict[tuple[str, Any], dict[int, StoredItem]],
    state: dict[str, Any],
    where: str,
) -> dict[str, dict[int, StoredItem]]:
    """Of the items several ranks stored (``copies``), keep one record where every copy holds the same
    value (the lowest rank's, already in ``items``); keep objects whose values differ per rank (taken
    out of ``items``, returned); refuse differing plain tensors."""
    per_rank: dict[str, dict[int, StoredItem]] = {}
    for key, by_rank in copies.items():
        first = items[key]
        value = _value_of(first)
        if all(_value_of(other) == value for other in by_rank.values()):
            continue
        fqn = key[0]
        if isinstance(state[fqn], BytesStorageMetadata):
            per_rank[fqn] = dict(by_rank)
            del items[key]
            continue
        groups: dict[Any, list[int]] = {}
        for rank, item in by_rank.items():
            groups.setdefault(_value_of(item), []).append(rank)
        refuse_differing_tensor(fqn, list(groups.values()), where)
    return per_rank


def refuse_differing_tensor(fqn: str, groups: list[list[int]], where: str) -> None:
    """Copies of a plain tensor differ: ``groups`` lists the ranks of each value."""
    described = "; ".join(f"ranks {_ranks(ranks)}" for ranks in groups)
    raise PerRankStateError(
        f"{where}: the ranks saved different values under the plain tensor key {fqn!r} ({described} each saved "
        "another value). A save with a coordinator refuses such a state; a save without one cannot compare "
        "before it commits, so this checkpoint does not load. Save per-rank tensors under per-rank keys "
        "(ckptio.PerRank) or as DTensors"
    )


def _value_of(item: StoredItem) -> tuple:
    """What decides that two copies hold the same value: equal CRC32Cs of equally encoded blocks (copies
    encoded differently, by ranks with different settings, are kept apart, never merged unchecked)."""
    return (item.kind, item.dtype, item.shape, item.logical_bytes, item.codec, item.block_size, item.blocks)


def check_replicas(fragments: list[Any], stored: Any, where: str) -> None:
    """Every chunk a rank held and left to another (each fragment's ``info.replicas``) is among the
    ``stored`` ``(key, offsets)`` (torch.Size keys hash as tuples)."""
    for fragment in fragments:
        for replica in fragment.info.replicas:
            if (replica.fqn, replica.offsets) not in stored:
                raise IncompleteCheckpointError(
                    f"{where}: rank {fragment.info.rank} holds key {replica.fqn!r} at {list(replica.offsets)} and left "
                    f"it to rank {replica.writer}, whose fragment does not store it: the ranks disagreed about who "
                    "writes it (different meshes or placements on different ranks?). Load an earlier checkpoint"
                )


def _ranks(ranks: list[int]) -> str:
    return f"{ranks[:16]}{' ...' if len(ranks) > 16 else ''}"
