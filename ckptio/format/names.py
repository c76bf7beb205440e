"""The format's vocabulary: file names, item kinds, the codec table and dtype names.

A checkpoint is a directory (or key prefix) holding::

    ckptio.json                       metadata, written last: its presence commits the save
    data-<save_id>-r<rank>.ckio       one per writing rank: items' blocks, back to back
    <xx>/data-<save_id>-r<rank>.ckio  the same, with spread key prefixes (``WriterConfig.key_prefix``,
                                      format version 5): xx, two hex digits of the name's SHA-256, puts
                                      the ranks' objects under many prefixes, so S3 partitions them apart
    ckptio.rank-<r>-of-<n>.json       a save without a coordinator (``dcp.save(use_collectives=False)``):
                                      each rank's own metadata instead of ckptio.json; the checkpoint is
                                      committed once all n ranks' fragments of one save are there
    ckptio.referenced-by-<name>.json  an incremental save (``WriterConfig.incremental_from``, format
                                      version 7) named ``<name>``, a sibling in the same folder, reads
                                      data files of this checkpoint: deletes keep them (``references.py``)
    ckptio.rebase                     a tiered incremental save's commit found its base missing: the ranks
                                      upload the full copies it lists (``tiers/rebase.py``); gone once committed

An incremental checkpoint names the data files of sibling checkpoints it references as
``../<sibling>/data-....ckio``: always the folder that wrote the bytes, so no load follows a chain.

A rank whose only items are its own small per-rank state stores them inline in ckptio.json
(base64, still checksummed per block) and creates no file.
"""

from __future__ import annotations

import enum
import hashlib
import re
from typing import Any, NamedTuple

import torch

from ckptio.errors import CheckpointFormatError

FORMAT_NAME = "ckptio"
#: ckptio 1.0's format (``tables``), frozen: the one a save writes and the newest a load reads; 1 to 7
#: are 0.x's (``ckptio.legacy``). What a save uses beyond the base is declared in the document's
#: ``features``; a later ckptio adds features, never versions.
FORMAT_VERSION = 8
#: Hex digits of a spread key prefix: 256 prefixes (S3 serves ~3,500 PUTs per second per partition).
KEY_PREFIX_DIGITS = 2
#: How ``files`` names the rule of its data files' key prefixes (``key_prefix``).
KEY_PREFIX_RULE = f"sha256-{KEY_PREFIX_DIGITS}"
METADATA_NAME = "ckptio.json"
TORCH_DCP_METADATA_NAME = ".metadata"
#: Beside a data file on the durable tier: a drain refused to upload it (its fast-tier copy failed a
#: check), so the commit waiting for it ends at once instead of at its timeout. Its text says why.
REFUSED_SUFFIX = ".refused"
#: The save id in a data file name: ``data-<save id>-r<rank>.ckio``.
SAVE_ID = "[0-9a-f]{8,32}"
_DATA_NAME = re.compile(rf"(?:([0-9a-f]{{{KEY_PREFIX_DIGITS}}})/)?data-({SAVE_ID})-r([0-9]{{5,}})\.ckio")
_DATA_NAMES = re.compile(rf"^{_DATA_NAME.pattern}$", re.MULTILINE)  # one name per line
_FRAGMENT_NAME = re.compile(r"ckptio\.rank-([0-9]{5,})-of-([0-9]{5,})\.json")
#: A sibling checkpoint's folder name, as an incremental checkpoint names it: one path segment that
#: cannot climb ('.', '..') or hide a separator or control character.
_SIBLING = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._=+,@-]{0,254}")
SIBLING_PREFIX = "../"
REFERENCE_MARKER_PREFIX = "ckptio.referenced-by-"
REBASE_NAME = "ckptio.rebase"


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
    spread: bool = False  # under its key prefix (``key_prefix``)


def key_prefix(plain_name: str) -> str:
    """The spread key prefix of a plain data file name: the first hex digits of its SHA-256 (the save id
    is in the name, so a rank's file moves from prefix to prefix across saves)."""
    return hashlib.sha256(plain_name.encode()).hexdigest()[:KEY_PREFIX_DIGITS]


def data_file_name(save_id: str, rank: int, spread: bool = False) -> str:
    plain = f"data-{save_id}-r{rank:05d}.ckio"
    return f"{key_prefix(plain)}/{plain}" if spread else plain


def parse_data_file_names(names: list[str]) -> tuple[list[str], list[int], bool]:
    """The save ids and ranks of data-file names, and whether they are spread (one pattern search
    over all of them: 8,192 names in ~2 ms rather than ~10 ms name by name); ``ValueError`` if one is
    not such a name, or the names are spread and plain at once."""
    if not names:
        return [], [], False
    joined = "\n".join(names)
    found = _DATA_NAMES.findall(joined)
    spread = {bool(prefix) for prefix, _, _ in found}
    wrong_prefix = spread == {True} and any(
        key_prefix(name[KEY_PREFIX_DIGITS + 1 :]) != name[:KEY_PREFIX_DIGITS] for name in names
    )
    if len(found) != len(names) or joined.count("\n") != len(names) - 1 or wrong_prefix:  # each name whole
        bad = next(name for name in names if parse_data_file_name(name) is None)
        raise ValueError(f"{bad!r} is not a ckptio data file name")
    if len(spread) > 1:
        raise ValueError(f"data file names with and without key prefixes in one checkpoint: {names[0]!r}, ...")
    return [save_id for _, save_id, _ in found], [int(rank) for _, _, rank in found], spread == {True}


def parse_data_file_name(name: str) -> DataFileName | None:
    """``(save_id, rank, spread)`` of a data-file name, plain or under its own key prefix; ``None`` for
    anything else (other paths, '..', newlines, a prefix that is not the name's)."""
    match = _DATA_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        return None
    prefix, save_id, rank = match.groups()
    if prefix is not None and key_prefix(name[len(prefix) + 1 :]) != prefix:
        return None
    return DataFileName(save_id, int(rank), prefix is not None)


def is_data_file_name(name: str) -> bool:
    return parse_data_file_name(name) is not None


def is_sibling_name(name: Any) -> bool:
    """Whether ``name`` may name a sibling checkpoint's folder (see ``_SIBLING``)."""
    return isinstance(name, str) and _SIBLING.fullmatch(name) is not None


def sibling_file_name(sibling: str, name: str) -> str:
    """How a checkpoint names data file ``name`` of its sibling checkpoint ``sibling``."""
    return f"{SIBLING_PREFIX}{sibling}/{name}"


def split_sibling_file_name(name: str) -> tuple[str | None, str]:
    """``(sibling, its data file name)`` of a sibling's data file, ``(None, name)`` for an own one."""
    if not name.startswith(SIBLING_PREFIX):
        return None, name
    sibling, _, own = name[len(SIBLING_PREFIX) :].partition("/")
    return sibling, own


def own_file_names(names: Any) -> list[str]:
    """The names among ``names`` of data files in the checkpoint's own folder (not a sibling's): what
    deleting or replacing the checkpoint may delete."""
    return [name for name in names if not name.startswith(SIBLING_PREFIX)]


def reference_marker_name(referrer: str, rank: int | None = None) -> str:
    """The marker an incremental checkpoint named ``referrer`` leaves in each sibling it references; with
    ``rank``, one rank's of a save without a coordinator (each lists the files its own fragment names)."""
    return f"{REFERENCE_MARKER_PREFIX}{referrer}{'' if rank is None else f'{_MARKER_RANK}{rank:05d}'}.json"


#: Between a referrer's name and a rank in a marker's name: no sibling name holds ``~``.
_MARKER_RANK = "~rank-"


def parse_reference_marker_name(name: str) -> str | None:
    """The referrer's folder name of a reference marker's name (any rank's), else ``None``."""
    if not name.startswith(REFERENCE_MARKER_PREFIX) or not name.endswith(".json"):
        return None
    referrer, _, rank = name[len(REFERENCE_MARKER_PREFIX) : -len(".json")].partition(_MARKER_RANK)
    if rank and not (rank.isdecimal() and rank.isascii() and len(rank) >= 5):
        return None
    return referrer if is_sibling_name(referrer) else None


class FragmentName(NamedTuple):
    rank: int
    ranks: int  # how many fragments the save wrote


def fragment_name(rank: int, ranks: int) -> str:
    """The name of rank ``rank``'s metadata fragment of a save by ``ranks`` ranks without a coordinator."""
    return f"ckptio.rank-{rank:05d}-of-{ranks:05d}.json"


def parse_fragment_name(name: str) -> FragmentName | None:
    """``(rank, ranks)`` of a fragment's name, written as ``fragment_name`` writes it; ``None`` otherwise."""
    match = _FRAGMENT_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        return None
    rank, ranks = int(match[1]), int(match[2])
    return FragmentName(rank, ranks) if rank < ranks and fragment_name(rank, ranks) == name else None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any, where: str = "ckptio metadata") -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise CheckpointFormatError(f"{where}: unknown dtype {name!r:.40}")
    return value
