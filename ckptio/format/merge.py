"""The one merge of a save without a coordinator: its ranks' fragments (each a 1.0 document with the
``fragment`` feature, decoded and checked by the one decoder) concatenated into one document's tables.

What joining needs is checked here (``fragments`` states the rule and words the refusals): one save,
every rank once, a key stored alike by every rank (kind, dtype, shape, path), a chunk's box alike, a
data file named once, every replica stored by its writer, and the one rule for copies: items several
ranks stored under one key and box are kept once when equal (equal CRC32Cs of equally encoded blocks),
objects that differ are kept per rank, plain tensors that differ are refused. Everything the merged
document shows (tiling and cover, spans, codecs, lengths) is checked when it is decoded, as any
``ckptio.json`` is.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np

from ckptio.errors import CheckpointFormatError, IncompleteCheckpointError, MixedFragmentsError
from ckptio.format.decode import decode_path
from ckptio.format.fragments import (
    check_one_save,
    refuse_differing_tensor,
    refuse_file_twice,
    refuse_kinds,
    refuse_paths,
    refuse_shapes,
    refuse_sizes,
)
from ckptio.format.names import SIBLING_PREFIX
from ckptio.format.records import VIRTUAL_PREFIX, ChainRecord, Extent
from ckptio.format.tables import (
    FRAGMENT,
    INCREMENTAL,
    MAX_RANK,
    PER_RANK,
    TENSOR,
    Tables,
    block_lengths,
    boxed_keys,
)


@dataclasses.dataclass
class _Keys:
    """Every key of the set, numbered as first met (rank by rank), with what every fragment must store alike."""

    number: dict[str, int] = dataclasses.field(default_factory=dict)
    names: list[str] = dataclasses.field(default_factory=list)
    signature: list[tuple] = dataclasses.field(default_factory=list)  # (kind, dtype, shape, path)
    requires_grad: list[int] = dataclasses.field(default_factory=list)

    def numbers(self, tables: Tables, where: str) -> np.ndarray:
        paths = tables.paths or [None] * len(tables.names)
        dtypes, grads = [tables.dtypes[d] for d in tables.dtype.tolist()], tables.requires_grad.tolist()
        tensor = iter(zip(dtypes, tables.shapes, grads, strict=True))
        out = []
        for fqn, kind, path in zip(tables.names, tables.kind.tolist(), paths, strict=True):
            dtype, shape, grad = next(tensor) if kind == TENSOR else (None, None, 0)
            signature = (kind, dtype, shape, path)  # a path code as the fragment stores it (a list)
            number = self.number.get(fqn)
            if number is None:
                number = self.number[fqn] = len(self.names)
                self.names.append(fqn)
                self.signature.append(signature)
                self.requires_grad.append(grad)
            elif self.signature[number] != signature:
                self._refuse(fqn, self.signature[number], signature, where)
            out.append(number)
        return np.array(out, dtype=np.int64)

    @staticmethod
    def _refuse(fqn: str, known: tuple, mine: tuple, where: str) -> None:
        if (known[0] == TENSOR) != (mine[0] == TENSOR):
            refuse_kinds(fqn, mine[0] == TENSOR, known[0] == TENSOR, where)
        if known[1:3] != mine[1:3]:
            refuse_shapes(fqn, mine[1:3], known[1:3], where)
        refuse_paths(fqn, _readable(fqn, mine[3]), _readable(fqn, known[3]), where)


def _readable(fqn: str, code: Any) -> Any:
    """A key's path for a message: decoded from its code, or the code where it does not decode."""
    try:
        return decode_path(fqn, code, MAX_RANK, "")
    except CheckpointFormatError:
        return code


def merge_tables(fragments: list[tuple[str, str, Tables]], where: str) -> Tables:
    """The tables of a complete set of fragments (name, where read, decoded tables; one per rank)."""
    fragments = sorted(fragments, key=lambda f: f[2].fragment.rank)  # type: ignore[union-attr]
    check_one_save([(name, read_from, t.fragment) for name, read_from, t in fragments], where)
    keys = _Keys()
    parts: dict[str, list[Any]] = {name: [] for name in ("key", "rank", "length", "file", "at", "codec", "block")}
    boxes: list[tuple[np.ndarray, np.ndarray]] = []
    crcs, digests, block_starts = [], [], []
    inline: dict[int, bytes] = {}
    files, writers = _data_files(fragments)
    number = {name: n for n, name in enumerate(files, 1)}
    extents: dict[str, tuple[Extent, ...]] = {}
    items = blocks = 0
    for _, read_from, t in fragments:
        if (t.kind == PER_RANK).any():
            raise CheckpointFormatError(f"{read_from} keeps objects per rank, which only a merge does")
        rank = t.fragment.rank  # type: ignore[union-attr]
        own = len(t.files) - len(t.extents)
        numbers = np.zeros(len(t.files) + 1, dtype=np.int64)  # the fragment's file numbers -> the merged ones
        numbers[1 : own + 1] = [number[name] for name in t.files[:own]]
        numbers[own + 1 :] = np.arange(len(t.extents)) + len(files) + len(extents) + 1  # after every data file
        for k, runs in enumerate(t.extents.values(), len(extents) + 1):
            extents[f"{VIRTUAL_PREFIX}{k}"] = runs
        parts["key"].append(keys.numbers(t, read_from)[t.item_keys])
        parts["rank"].append(np.full(len(t.length), rank, dtype=np.int64))
        parts["length"].append(t.length)
        parts["file"].append(numbers[t.file])
        parts["at"].append(t.at)
        parts["codec"].append(t.codec)
        parts["block"].append(t.item_block_size)
        boxes.append((t.offsets, t.sizes))
        inline.update((items + i, data) for i, data in t.inline.items())
        crcs.append(t.crc_array())
        digests.append(t.digest_array())
        block_starts.append(t.starts[:-1] + blocks)
        items += len(t.length)
        blocks += int(t.starts[-1])
    column = {name: np.concatenate(values) if values else np.zeros(0, np.int64) for name, values in parts.items()}
    offsets, sizes = _padded(boxes)
    starts = np.concatenate([*block_starts, [blocks]])
    crc = np.concatenate(crcs)
    compressed = any(t.stored is not None for _, _, t in fragments)  # else every length follows from its item
    lengths = np.concatenate([block_lengths(t).astype(np.int32) for _, _, t in fragments]) if compressed else None
    keep, per_rank_keys = _one_copy_each(keys, column, offsets, sizes, starts, crc, lengths, where)
    _check_replicas(fragments, keys, column["key"][keep], offsets[keep])
    order = keep[np.argsort(column["key"][keep], kind="stable")]
    kind = np.array([signature[0] for signature in keys.signature], dtype=np.int64)
    kind[sorted(per_rank_keys)] = PER_RANK
    first = fragments[0][2]
    tensors = [s for s in keys.signature if s[0] == TENSOR]
    dtypes = sorted({s[1] for s in tensors})
    block_index = _block_index(starts, order)
    all_digests = None if any(d is None for d in digests) else np.concatenate(digests).reshape(-1, 4)
    features = set().union(*(t.features for _, _, t in fragments)) - {FRAGMENT}
    chain = _joined_chain(fragments, files, extents, column, order, starts, lengths)
    if all_digests is None and chain is None and not extents and not any(map(is_sibling_file, files)):
        features.discard(INCREMENTAL)
    header = dataclasses.replace(
        first.header,
        files=files,
        writer_ranks=writers,
        chain=chain,
        world_size=len(fragments),
        created_unix=max(t.header.created_unix for _, _, t in fragments),
        mesh=next((t.header.mesh for _, _, t in fragments if t.header.mesh), None),
    )
    paths, planner_data = _planner(fragments, keys, where)
    tables = Tables(
        header=header,
        features=frozenset(features),
        files=tuple(files) + tuple(extents),
        block_size=first.block_size,
        planner_data=planner_data,
        names=keys.names,
        paths=paths,
        kind=kind,
        count=np.bincount(column["key"][order], minlength=len(keys.names)),
        dtypes=dtypes,
        dtype=np.array([dtypes.index(s[1]) for s in tensors], dtype=np.int64),
        shapes=[s[2] for s in tensors],
        requires_grad=np.array([g for s, g in zip(keys.signature, keys.requires_grad, strict=True) if s[0] == TENSOR]),
        boxed=np.ones(len(tensors), dtype=bool),
        offsets=offsets[order],
        sizes=sizes[order],
        ranks=np.where(np.isin(column["key"][order], sorted(per_rank_keys)), column["rank"][order], -1),
        length=column["length"][order],
        file=column["file"][order],
        at=column["at"][order],
        codec=column["codec"][order],
        item_block_size=column["block"][order],
        inline={n: inline[i] for n, i in enumerate(order.tolist()) if i in inline},
        starts=np.concatenate(([0], np.cumsum(starts[order + 1] - starts[order]))),
        crc=crc[block_index],
        stored=lengths[block_index].astype(np.int64) if lengths is not None else None,
        digests=None if all_digests is None else all_digests[block_index].reshape(-1),
        extents=extents,
    )
    tables.boxed = boxed_keys(tables)
    return tables


def is_sibling_file(name: str) -> bool:
    return name.startswith(SIBLING_PREFIX)


def _data_files(fragments: list[tuple[str, str, Tables]]) -> tuple[dict[str, int], dict[str, int]]:
    """Every data file the fragments name, once, in order of first naming, with its size; and the writer
    of each of the save's own (a sibling's, which an incremental save references, has its name's). A
    file of the save is named by its writer's fragment alone; a sibling's file by any that reference it,
    at the size its checkpoint records."""
    files: dict[str, int] = {}
    writers: dict[str, int] = {}
    named_by: dict[str, int] = {}
    for _, read_from, t in fragments:
        rank = t.fragment.rank  # type: ignore[union-attr]
        for name, size in t.header.files.items():
            sibling = is_sibling_file(name)
            if name in files and not (sibling and files[name] == size):
                refuse_file_twice(name, named_by[name], read_from)
            files[name] = size
            named_by.setdefault(name, rank)
            if not sibling:
                writers[name] = t.header.writer_ranks.get(name, rank)
    return files, writers


def _joined_chain(
    fragments: list[tuple[str, str, Tables]], files: dict[str, int], extents: dict[str, tuple[Extent, ...]],
    column: dict[str, np.ndarray], kept: np.ndarray, starts: np.ndarray, lengths: np.ndarray | None,
) -> ChainRecord | None:  # fmt: skip
    """An incremental save's chain record from its ranks' parts: the base they referenced (each rank
    resolved it alone: "unknown" where they differ, as a coordinator records it), the deepest depth, and
    of the kept items' stored bytes (each copy once) those in the base's files."""
    chains = [t.header.chain for _, _, t in fragments if t.header.chain is not None]
    if not chains:
        return None
    bases = {chain.base for chain in chains}
    if lengths is None:  # raw: a block's stored bytes are its logical ones
        stored_of = column["length"][kept]
    else:
        ends = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
        stored_of = ends[starts[kept + 1]] - ends[starts[kept]]
    names = [*files, *extents]
    in_sibling = np.array([False] + [is_sibling_file(name) for name in names])[column["file"][kept]]
    referenced = int(stored_of[in_sibling].sum())
    for number in set(column["file"][kept].tolist()) - {0}:
        if number > len(files):  # an item in pieces: its runs in the base's files
            referenced += sum(run.length for run in extents[names[number - 1]] if is_sibling_file(run.file))
    return ChainRecord(
        bases.pop() if len(bases) == 1 else "unknown",
        max(chain.depth for chain in chains),
        referenced,
        int(stored_of.sum()),
    )


def _padded(boxes: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The fragments' boxes in one pair of arrays, as wide as the widest."""
    dims = max((o.shape[1] for o, _ in boxes), default=0)
    rows = sum(len(o) for o, _ in boxes)
    offsets, sizes = np.zeros((rows, dims), dtype=np.int64), np.zeros((rows, dims), dtype=np.int64)
    at = 0
    for o, s in boxes:
        offsets[at : at + len(o), : o.shape[1]] = o
        sizes[at : at + len(o), : o.shape[1]] = s
        at += len(o)
    return offsets, sizes


def _block_index(starts: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The blocks of the items ``order``, in turn: one array, built in place (a set of 8,192 fragments
    has millions of blocks)."""
    lengths = starts[order + 1] - starts[order]
    held = lengths > 0
    first, lengths = starts[order][held], lengths[held]
    total = int(lengths.sum())
    index = np.ones(total, dtype=np.int32 if int(starts[-1]) < 1 << 31 else np.int64)
    if total:
        at = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        index[0] = first[0]
        index[at[1:]] = first[1:] - (first[:-1] + lengths[:-1] - 1)  # from the last block of the item before
        np.cumsum(index, out=index)
    return index


def _one_copy_each(
    keys: _Keys, column: dict[str, np.ndarray], offsets: np.ndarray, sizes: np.ndarray, starts: np.ndarray,
    crc: np.ndarray, lengths: np.ndarray | None, where: str,
) -> tuple[np.ndarray, set[int]]:  # fmt: skip
    """The items to keep (by position): each (key, box) once where its copies are equal; every copy of an
    object whose copies differ (those keys are returned: kept per rank); differing plain tensors refused."""
    first, group = _groups(np.column_stack([column["key"], offsets]))
    copies = np.flatnonzero(first[group] != np.arange(len(group)))
    if not len(copies):
        return np.sort(first), set()
    firsts = first[group[copies]]  # the copy each is compared with: the lowest rank's
    wrong = (sizes[copies] != sizes[firsts]).any(axis=1)
    if wrong.any():
        i, j = int(copies[np.argmax(wrong)]), int(firsts[np.argmax(wrong)])
        refuse_sizes(keys.names[column["key"][i]], offsets[i].tolist(), sizes[i].tolist(), sizes[j].tolist(), where)
    same = np.ones(len(copies), dtype=bool)
    for name in ("length", "codec", "block"):
        same &= column[name][copies] == column[name][firsts]
    alike, twins = copies[same], firsts[same]  # as many blocks each: compare them all at once
    mine, theirs = _block_index(starts, alike), _block_index(starts, twins)
    equal = crc[mine] == crc[theirs]
    if lengths is not None:
        equal &= lengths[mine] == lengths[theirs]
    counts = starts[alike + 1] - starts[alike]
    blocks_equal = np.ones(len(alike), dtype=bool)
    if len(equal):
        segments = np.concatenate(([0], np.cumsum(counts)[:-1]))[counts > 0]
        blocks_equal[counts > 0] = np.logical_and.reduceat(equal, segments)
    same[same] = blocks_equal
    differing: dict[int, set[int]] = {}
    for i, j in zip(copies[~same].tolist(), firsts[~same].tolist(), strict=True):
        differing.setdefault(j, {j}).add(i)
    per_rank: set[int] = set()
    keep = np.zeros(len(group), dtype=bool)
    keep[first] = True
    for j, members in differing.items():
        key = int(column["key"][j])
        if keys.signature[key][0] == TENSOR:
            by_value: dict[bytes, list[int]] = {}
            for i in sorted(members | set(np.flatnonzero(group == group[j]).tolist())):
                blocks = slice(starts[i], starts[i + 1])
                value = crc[blocks].tobytes() + (b"" if lengths is None else lengths[blocks].tobytes())
                by_value.setdefault(value, []).append(int(column["rank"][i]))
            refuse_differing_tensor(keys.names[key], list(by_value.values()), where)
        per_rank.add(key)
        keep[group == group[j]] = True
    return np.flatnonzero(keep), per_rank


def _groups(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Equal rows grouped: each group's first row (lowest position), and each row's group (as
    ``np.unique(rows, axis=0, return_index=True, return_inverse=True)``, in a third of its memory)."""
    order = np.lexsort(rows.T[::-1])  # stable: within a group, by position
    starts = np.ones(len(rows), dtype=bool)
    if len(rows):
        ordered = rows[order]
        starts[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
        del ordered
    group = np.empty(len(rows), dtype=np.int64)
    group[order] = np.cumsum(starts) - 1
    return order[starts], group


def _check_replicas(
    fragments: list[tuple[str, str, Tables]], keys: _Keys, kept_keys: np.ndarray, offsets: np.ndarray
) -> None:
    """Every chunk a rank held and left to another (its fragment's replicas) is among the kept items:
    the replicas of every fragment as rows of (key, offsets...) searched at once among the sorted rows of
    the kept items of the keys they name (a set of tuples of every item took ~50 MiB at 8,192 FSDP
    fragments; searching fragment by fragment took a tenth of an FSDP+TP merge)."""
    held = [t.fragment.replicas for _, _, t in fragments]  # type: ignore[union-attr]
    names = list(itertools.chain.from_iterable(replicas.keys for replicas in held))
    if not names:
        return
    dims = offsets.shape[1]
    named = np.isin(kept_keys, [keys.number[fqn] for fqn in set(names) if fqn in keys.number])
    stored = np.sort(_rows(np.column_stack([kept_keys[named], offsets[named]])))
    boxes = list(itertools.chain.from_iterable(replicas.offsets for replicas in held))
    wanted = _rows(_replica_rows(names, boxes, keys, dims))
    at = np.minimum(np.searchsorted(stored, wanted), max(len(stored) - 1, 0))
    found = stored[at] == wanted if len(stored) else np.zeros(len(wanted), dtype=bool)
    if found.all():
        return
    missing = int(np.argmin(found))
    counts = np.cumsum([len(replicas) for replicas in held])
    fragment = int(np.searchsorted(counts, missing, side="right"))
    _, read_from, t = fragments[fragment]
    replica = held[fragment][missing - (int(counts[fragment - 1]) if fragment else 0)]
    raise IncompleteCheckpointError(
        f"{read_from}: rank {t.fragment.rank} holds key {replica.fqn!r} at {list(replica.offsets)} and "  # type: ignore[union-attr]
        f"left it to rank {replica.writer}, whose fragment does not store it: the ranks disagreed about "
        "who writes it (different meshes or placements on different ranks?). Load an earlier checkpoint"
    )


def _replica_rows(names: list[str], boxes: list[Any], keys: _Keys, dims: int) -> np.ndarray:
    """Replicas as rows (key number, offsets padded to ``dims``); -1 for a key no fragment stores or a box
    of more dimensions than any stored one (never found)."""
    rows = np.zeros((len(names), dims + 1), dtype=np.int64)
    rows[:, 0] = [keys.number.get(fqn, -1) for fqn in names]
    widths = set(map(len, boxes))
    if len(widths) == 1 and (width := widths.pop()) <= dims:  # as every fragment DCP writes
        flat = np.fromiter(itertools.chain.from_iterable(boxes), dtype=np.int64, count=len(boxes) * width)
        rows[:, 1 : width + 1] = flat.reshape(-1, width)
        return rows
    for i, box in enumerate(boxes):
        if len(box) > dims:
            rows[i, 0] = -1
        else:
            rows[i, 1 : len(box) + 1] = box
    return rows


def _rows(table: np.ndarray) -> np.ndarray:
    """Each row of a 2-D int64 array as one comparable value (its bytes), to sort and search rows."""
    table = np.ascontiguousarray(table, dtype=np.int64)
    return table.view(np.dtype((np.void, 8 * table.shape[1]))).ravel()


def _planner(fragments: list[tuple[str, str, Tables]], keys: _Keys, where: str) -> tuple[list | None, Any]:
    """Each key's path code when every fragment stores paths (compared with the keys), else torch's
    planner data joined."""
    if all(t.paths is not None for _, _, t in fragments):
        return [None if s[3] is None else list(s[3]) for s in keys.signature], None
    joined: dict[str, Any] = {}
    for _, read_from, t in fragments:
        for fqn, path in (t.planner_data or {}).items():
            if joined.setdefault(fqn, path) != path:
                refuse_paths(fqn, path, joined[fqn], read_from)
    if joined and set(joined) - set(keys.number):
        raise MixedFragmentsError(f"{where}: a fragment's planner data names keys it does not store")
    return None, joined or None
