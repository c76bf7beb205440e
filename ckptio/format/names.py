"""The format's vocabulary: file names, item kinds, the codec table and dtype names.

A checkpoint is a directory (or key prefix) holding::

    ckptio.json                       metadata, written last: its presence commits the save
    data-<save_id>-r<rank>.ckio       one per writing rank: items' blocks, back to back

A rank whose only items are its own small per-rank state stores them inline in ckptio.json
(base64, still checksummed per block) and creates no file.
"""

from __future__ import annotations

import enum
import re
from typing import Any, NamedTuple

import torch

from ckptio.errors import CheckpointFormatError

FORMAT_NAME = "ckptio"
#: The format this ckptio writes, and the newest it reads (``versions`` says how each is read).
FORMAT_VERSION = 4
METADATA_NAME = "ckptio.json"
TORCH_DCP_METADATA_NAME = ".metadata"
#: The save id in a data file name: ``data-<save id>-r<rank>.ckio``.
SAVE_ID = "[0-9a-f]{8,32}"
_DATA_NAME = re.compile(rf"data-({SAVE_ID})-r([0-9]{{5,}})\.ckio")
_DATA_NAMES = re.compile(rf"^{_DATA_NAME.pattern}$", re.MULTILINE)  # one name per line


class ItemKind(str, enum.Enum):
    """What an item holds: a tensor chunk (raw row-major bytes) or a pickled object."""

    TENSOR = "tensor"
    BYTES = "bytes"


class Codec(str, enum.Enum):
    """How an item's blocks are stored (``codec.py`` encodes and decodes them)."""

    RAW = "raw"
    ZSTD = "zstd"
    ZSTD_BYTEPLANES = "zstd-byteplanes"  # format version 2

    @property
    def format_version(self) -> int:
        """The oldest format version that has this codec."""
        return 2 if self is Codec.ZSTD_BYTEPLANES else 1


#: The codec table: version 3 stores a codec as its position here (a format constant: append only).
CODECS = tuple(Codec)
#: Bytes per element of the tensors the byte-plane codec takes.
PLANE_ITEMSIZES = (2, 4, 8)


class DataFileName(NamedTuple):
    save_id: str
    rank: int


def data_file_name(save_id: str, rank: int) -> str:
    return f"data-{save_id}-r{rank:05d}.ckio"


def parse_data_file_names(names: list[str]) -> tuple[list[str], list[int]]:
    """The save ids and ranks of plain data-file names (one pattern search over all of them: 8,192
    names in ~2 ms rather than ~10 ms name by name); ``ValueError`` if one is not such a name."""
    if not names:
        return [], []
    joined = "\n".join(names)
    found = _DATA_NAMES.findall(joined)
    if len(found) != len(names) or joined.count("\n") != len(names) - 1:  # a name per line, each whole
        bad = next(name for name in names if parse_data_file_name(name) is None)
        raise ValueError(f"{bad!r} is not a ckptio data file name")
    return [save_id for save_id, _ in found], [int(rank) for _, rank in found]


def parse_data_file_name(name: str) -> DataFileName | None:
    """``(save_id, rank)`` of a plain data-file name; ``None`` for anything else (paths, '..', newlines)."""
    match = _DATA_NAME.fullmatch(name) if isinstance(name, str) else None
    return DataFileName(match.group(1), int(match.group(2))) if match else None


def is_data_file_name(name: str) -> bool:
    return parse_data_file_name(name) is not None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any, where: str = "ckptio metadata") -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise CheckpointFormatError(f"{where}: unknown dtype {name!r:.40}")
    return value
