"""A save without a coordinator (``dcp.save(..., use_collectives=False)``): each rank's metadata
fragment, and the one rule that merges a complete set of them into an ordinary checkpoint's metadata.

Each rank commits ``ckptio.rank-<r>-of-<n>.json`` (``names.fragment_name``): a metadata document of
the items it wrote, like ``ckptio.json``, plus a ``fragment`` field::

    "fragment": {"save_id": "9f0c...", "rank": 3, "ranks": 8,
                 "replicas": {"keys": ["model.w", ...], "offsets": [[0, 0], ...], "writers": [1, ...]}}

``save_id`` is the same on every rank of one save and differs between saves; ``replicas`` lists the
chunks this rank holds but left to another rank (``writers``), decided from the placements every
holder sees alike. The checkpoint is committed when all ``ranks`` fragments of one save are present.
``merge.py`` joins them: one save, every rank once, one rank count, every replica written by its
writer; items several ranks wrote under one key (objects and plain tensors: no rank knows who else
holds them, so every holder stores its own) are kept once when they are equal; objects that differ
are kept per rank, as ``WriterConfig(differing_objects="keep_per_rank")`` keeps them; plain tensors
that differ are refused, as a save with a coordinator refuses them. The refusals are worded here. No
I/O: ``loading/fragment_set.py`` lists and reads the fragments.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from ckptio.config import INT64_LIMIT
from ckptio.errors import CheckpointFormatError, IncompleteCheckpointError, MixedFragmentsError, PerRankStateError
from ckptio.format.names import FragmentName, fragment_name
from ckptio.format.rules import require_count, require_counts

#: The field of a fragment document that makes it one.
FRAGMENT_FIELD = "fragment"
_SAVE_ID = re.compile("[0-9a-f]{16,64}")


class Replica(NamedTuple):
    """A chunk a rank holds and another rank writes."""

    fqn: str
    offsets: tuple[int, ...]
    writer: int


@dataclasses.dataclass(frozen=True)
class Replicas:
    """A fragment's replicas as its three columns (a fragment at scale lists hundreds; a merge of 8,192
    HSDP fragments spent a fifth of its time making and reading a tuple per replica)."""

    keys: Sequence[str] = ()
    offsets: Sequence[Sequence[int]] = ()
    writers: Sequence[int] = ()

    @classmethod
    def of(cls, replicas: Iterable[Replica]) -> "Replicas":
        """The columns of ``replicas``, sorted by key and offsets."""
        ordered = sorted(replicas, key=lambda r: (r.fqn, r.offsets))
        return cls([r.fqn for r in ordered], [list(r.offsets) for r in ordered], [r.writer for r in ordered])

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> Replica:
        return Replica(self.keys[i], tuple(self.offsets[i]), self.writers[i])


@dataclasses.dataclass(frozen=True)
class FragmentInfo:
    """A fragment's own record: which save it belongs to, whose it is, and what it left to others."""

    save_id: str
    rank: int
    ranks: int
    replicas: Replicas = Replicas()

    def to_json(self) -> dict[str, Any]:
        return {
            "save_id": self.save_id,
            "rank": self.rank,
            "ranks": self.ranks,
            "replicas": {
                "keys": list(self.replicas.keys),
                "offsets": [list(box) for box in self.replicas.offsets],
                "writers": list(self.replicas.writers),
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
        if not _plain_replicas(keys, offsets, writers, ranks):  # checked in bulk: the usual case
            for fqn, box, writer in zip(keys, offsets, writers, strict=True):  # which replica is wrong, and how
                if not isinstance(fqn, str) or not isinstance(box, list):
                    raise CheckpointFormatError(f"{where}: a fragment replica is not (key, [offsets], writer)")
                writer = require_count(writer, f"the writer of replica {fqn!r:.80}", where)
                if not writer < ranks:
                    raise CheckpointFormatError(f"{where}: replica {fqn!r:.80} names writer rank {writer} of {ranks}")
                require_counts(box, where)
        return cls(save_id, rank, ranks, Replicas(keys, offsets, writers))


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


def refuse_differing_tensor(fqn: str, groups: list[list[int]], where: str) -> None:
    """Copies of a plain tensor differ: ``groups`` lists the ranks of each value."""
    described = "; ".join(f"ranks {_ranks(ranks)}" for ranks in groups)
    raise PerRankStateError(
        f"{where}: the ranks saved different values under the plain tensor key {fqn!r} ({described} each saved "
        "another value). A save with a coordinator refuses such a state; a save without one cannot compare "
        "before it commits, so this checkpoint does not load. Save per-rank tensors under per-rank keys "
        "(ckptio.PerRank) or as DTensors"
    )


def _ranks(ranks: list[int]) -> str:
    return f"{ranks[:16]}{' ...' if len(ranks) > 16 else ''}"
