"""ckptio 1.0's metadata in memory: the document's tables as columns (numpy arrays), one row per thing.

The encoder (``encode``) writes these tables, the decoder (``decode``) reads and checks them, the merge of
a save's fragments (``merge``) concatenates them and the view (``view``) answers DCP's questions from
them. ``docs/format.md`` states the schema; ``schema`` below names its parts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ckptio.format.fragments import FragmentInfo
from ckptio.format.records import Extent, Header

#: The features this ckptio reads: data files under spread key prefixes; a rank's fragment of a save
#: without a coordinator; an incremental save's block digests, sibling files, extents and chain.
KEY_PREFIX, FRAGMENT, INCREMENTAL = "key_prefix", "fragment", "incremental"
FEATURES = frozenset({KEY_PREFIX, FRAGMENT, INCREMENTAL})
#: A key's kind (the ``kind`` column): a tensor, an object stored once, an object kept per rank.
TENSOR, OBJECT, PER_RANK = 0, 1, 2
#: Dimensions of a tensor the format takes (torch itself stops at 64 in many operations).
MAX_DIMS = 64
#: A rank number in ``ranks``.
MAX_RANK = 10**9


@dataclasses.dataclass
class Tables:
    """One document's tables. Keys in order, each key's items in turn (DCP's chunk order), each item's
    blocks in turn. Tensor columns hold one row per tensor key; item columns one per item (a tensor's
    chunk, an object, a rank's copy of a per-rank object)."""

    header: Header  # files (name -> size) and writer_ranks among it
    features: frozenset[str]
    files: tuple[str, ...]  # item ``file`` n > 0 names files[n - 1]: the data files, then virtual ones
    block_size: int  # the document's default
    planner_data: Any  # torch's {key: path}, checked (a decoded document's; a save's when not as ``paths``)
    # keys
    names: list[str]
    paths: list[Any] | None  # each key's path code (``encode.path_code``), or None
    kind: np.ndarray
    count: np.ndarray  # items per key
    # tensor keys, in key order
    dtypes: list[str]
    dtype: np.ndarray  # index into dtypes
    shapes: list[tuple[int, ...]]
    requires_grad: np.ndarray
    boxed: np.ndarray  # whether the key's items carry boxes (several chunks, or one that is part of it)
    # items
    offsets: np.ndarray  # (items, dims): a tensor item's box; zeros for an object
    sizes: np.ndarray
    ranks: np.ndarray  # the rank of a per-rank object's copy; -1 elsewhere
    length: np.ndarray  # logical bytes
    file: np.ndarray  # 0: inline
    at: np.ndarray
    codec: np.ndarray
    item_block_size: np.ndarray
    inline: dict[int, bytes]  # item -> its stored bytes
    # blocks
    starts: np.ndarray  # each item's first block, then the end
    crc: Any  # np.ndarray of uint32, or columns.PackedBlocks (decoded on use)
    stored: np.ndarray | None  # stored length per block: when some item is compressed
    digests: Any  # 16 bytes per block (4 uint32 entries) or None
    extents: dict[str, tuple[Extent, ...]]  # virtual file (an item stored in pieces) -> its runs
    fragment: FragmentInfo | None = None

    @property
    def item_keys(self) -> np.ndarray:
        """The key of each item."""
        return np.repeat(np.arange(len(self.names)), self.count)

    @property
    def firsts(self) -> np.ndarray:
        """Each key's first item, then the end."""
        return np.concatenate(([0], np.cumsum(self.count)))

    def tensor_rows(self) -> np.ndarray:
        """Each key's row in the tensor columns (-1 for an object)."""
        tensor = self.kind == TENSOR
        return np.where(tensor, np.cumsum(tensor) - 1, -1)

    def crc_array(self) -> np.ndarray:
        return self.crc if isinstance(self.crc, np.ndarray) else self.crc.to_numpy().astype(np.uint32)

    def digest_array(self) -> np.ndarray | None:
        if self.digests is None or isinstance(self.digests, np.ndarray):
            return self.digests
        return self.digests.to_numpy().astype(np.uint32)


def block_counts(length: np.ndarray, block_size: np.ndarray) -> np.ndarray:
    """Blocks of each item: its logical bytes in blocks of its size (an empty item has none)."""
    return -(-length // block_size)


def block_lengths(tables: Tables) -> np.ndarray:
    """Each block's stored length: the ``stored`` column, or (every item raw) its logical length."""
    if tables.stored is not None:
        return tables.stored
    return logical_blocks(tables)[2]


def logical_blocks(tables: Tables) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each block: its item, its position in the item, and its logical length."""
    block_item = np.repeat(np.arange(len(tables.length)), np.diff(tables.starts))
    size = tables.item_block_size[block_item]
    position = np.arange(int(tables.starts[-1])) - tables.starts[:-1][block_item]
    return block_item, position, np.minimum(size, tables.length[block_item] - position * size)


def padded_shapes(shapes: list[tuple[int, ...]], dims: int, rows: int | None = None) -> np.ndarray:
    """The shapes as rows of ``dims`` entries (zeros past each one's own; ``rows`` rows, the rest zeros)."""
    out = np.zeros((len(shapes) if rows is None else rows, dims), dtype=np.int64)
    for row, shape in enumerate(shapes):
        out[row, : len(shape)] = shape
    return out


def boxed_keys(tables: Tables) -> np.ndarray:
    """Which tensor keys need their items' boxes: of other than one item, or of one that is not all of it."""
    tensor = np.flatnonzero(tables.kind == TENSOR)
    firsts = tables.firsts
    boxed = np.ones(len(tensor), dtype=bool)
    for row, k in enumerate(tensor.tolist()):
        if tables.count[k] == 1:
            i, shape = int(firsts[k]), tables.shapes[row]
            n = len(shape)
            boxed[row] = bool(tables.offsets[i, :n].any()) or tuple(tables.sizes[i, :n].tolist()) != shape
    return boxed
