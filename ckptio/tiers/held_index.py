"""What a rank's fast-tier data file holds, and which of a checkpoint's items a node can read locally.

A rank's fast-tier file holds everything the rank held at save time: first the items it was
assigned (byte for byte its durable data file, which the drain uploads), then the items other
ranks wrote for the durable tier (replicas), which it keeps so that it can restart on its own.
Its *held index* (``<file>.held.json``) records the file's sizes and, for each of those extra
items, where it lies and its blocks' lengths and CRC32Cs. An extra item stands in for the
checkpoint's record of the same key only when every block's length and checksum agree, so a
stale or foreign index can never make a load read other bytes than the checkpoint's.

The index is a cache: an unreadable one is ignored (with a warning) and the durable tier serves.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import mmap
import os
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ckptio.errors import CheckpointError
from ckptio.format.codec import checksum
from ckptio.format.columns import b64
from ckptio.format.document import decode_metadata
from ckptio.format.names import METADATA_NAME, parse_data_file_name
from ckptio.format.records import Manifest, Reference, StoredItem, placed_blocks
from ckptio.storage import FsspecStore
from ckptio.tiers.node_notes import is_note
from ckptio.tiers.paths import HELD_SUFFIX

log = logging.getLogger(__name__)

FORMAT = "ckptio-held-index"


@dataclasses.dataclass(frozen=True)
class HeldItem:
    fqn: str
    chunk_offset: tuple[int, ...] | None
    offset: int
    crc32c: str  # packed, as the metadata's version 1 schema packs them
    stored_lengths: str


@dataclasses.dataclass(frozen=True)
class HeldIndex:
    file: str
    local_bytes: int
    durable_bytes: int  # the file's first bytes are its durable data file; 0: nothing is uploaded
    extras: tuple[HeldItem, ...]

    def encode(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "version": 1,
                "file": self.file,
                "local_bytes": self.local_bytes,
                "durable_bytes": self.durable_bytes,
                "extras": [
                    [
                        i.fqn,
                        list(i.chunk_offset) if i.chunk_offset is not None else None,
                        i.offset,
                        i.crc32c,
                        i.stored_lengths,
                    ]
                    for i in self.extras
                ],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def of(cls, file: str, records: dict[MetadataIndex, StoredItem], durable: set[MetadataIndex]) -> "HeldIndex":
        """The index of ``file`` written with ``records``, those of ``durable`` first. Every record is listed,
        the durable ones too: the checkpoint may keep another rank's equal copy of an object or plain tensor
        this rank wrote (a save without a coordinator, or objects kept per rank), which the node holds."""
        durable_bytes = max((r.offset + r.stored_bytes for k, r in records.items() if k in durable), default=0)
        local_bytes = max((r.offset + r.stored_bytes for r in records.values()), default=0)
        return cls(file, local_bytes, durable_bytes, held_items(records))

    @classmethod
    def decode(cls, raw: bytes) -> "HeldIndex":
        """Parse an index; ``ValueError`` when it is not one (the caller ignores it)."""
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != 1:
            raise ValueError("not a ckptio held index of version 1")
        file, local, durable, extras = doc["file"], doc["local_bytes"], doc["durable_bytes"], doc["extras"]
        if parse_data_file_name(file) is None or not _count(local) or not _count(durable) or durable > local:
            raise ValueError("bad file name or sizes")
        if not isinstance(extras, list):
            raise ValueError("'extras' is not a list")
        items = []
        for entry in extras:
            fqn, chunk, at, crc, lengths = entry
            if not (isinstance(fqn, str) and _count(at) and isinstance(crc, str) and isinstance(lengths, str)):
                raise ValueError("bad extra item")
            if chunk is not None and not (isinstance(chunk, list) and all(_count(c) for c in chunk)):
                raise ValueError("bad chunk offset")
            items.append(HeldItem(fqn, tuple(chunk) if chunk is not None else None, at, crc, lengths))
        return cls(file, local, durable, tuple(items))


def held_items(records: dict[MetadataIndex, StoredItem]) -> tuple[HeldItem, ...]:
    """The index entries of ``records`` (those stored back to back in the file, not in pieces or inline)."""
    return tuple(
        HeldItem(k.fqn, tuple(k.offset) if k.offset is not None else None, r.offset, *_fingerprint(r))
        for k, r in records.items()
        if r.inline is None and not isinstance(r, Reference)
    )


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 63


def _fingerprint(record: StoredItem) -> tuple[str, str]:
    """A record's block CRC32Cs and stored lengths, each as the base64 of little-endian uint32s."""
    blocks = np.array(record.blocks, dtype="<u4").reshape(-1, 2)
    return b64(blocks[:, 1].tobytes()), b64(blocks[:, 0].tobytes())


@dataclasses.dataclass
class LocalCopies:
    """What of one checkpoint a node's fast tier holds, checked against its metadata."""

    #: the checkpoint's data files held whole (a fast-tier file whose first bytes are it)
    files: set[str] = dataclasses.field(default_factory=set)
    #: items held as replicas in another fast-tier file: the checkpoint's record, relocated there
    relocated: dict[MetadataIndex, StoredItem] = dataclasses.field(default_factory=dict)
    #: fast-tier file -> its size
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)
    #: the saving ranks whose whole file and index are here and agree with the metadata
    complete_ranks: set[int] = dataclasses.field(default_factory=set)

    @property
    def local_files(self) -> set[str]:
        """Every file name a load reads from the fast tier."""
        return self.files | {record.file for record in self.relocated.values()}

    def drop(self, file: str) -> None:
        """Hold nothing of fast-tier file ``file`` (a damaged copy): neither it nor the replicas in it, and
        its saving rank is no longer complete here."""
        self.files.discard(file)
        self.relocated = {key: item for key, item in self.relocated.items() if item.file != file}
        parsed = parse_data_file_name(file)
        if parsed is not None:
            self.complete_ranks.discard(parsed.rank)


def local_copies(local: FsspecStore, manifest: Manifest) -> LocalCopies:
    """What ``local`` (a node's fast-tier folder of the checkpoint) holds of ``manifest``'s items. A rank
    of an incremental save has two files there (``writing.py``): it is complete when both are."""
    found = LocalCopies()
    incomplete: set[int] = set()
    for name in local.list_names(nested=True) or []:
        if not name.endswith(HELD_SUFFIX):
            continue
        try:
            index = HeldIndex.decode(local.read(name))
            if index.file + HELD_SUFFIX != name:
                raise ValueError(f"it describes {index.file}")
            size = local.size(index.file)
        except (ValueError, KeyError, TypeError, OSError, json.JSONDecodeError) as exc:
            log.warning("ckptio: ignoring the fast-tier index %s: %s", local.describe(name), exc)
            continue
        except Exception as exc:  # noqa: BLE001 - a cache: the durable tier serves instead
            log.warning("ckptio: cannot read the fast-tier copy %s: %s", local.describe(name), exc)
            continue
        if size != index.local_bytes:
            log.warning(
                "ckptio: the fast-tier file %s holds %d bytes, its index records %d; reading it from the durable tier",
                local.describe(index.file),
                size,
                index.local_bytes,
            )
            continue
        if not _add(found, index, manifest):
            incomplete.add(parse_data_file_name(index.file).rank)
    found.complete_ranks -= incomplete
    return found


def _add(found: LocalCopies, index: HeldIndex, manifest: Manifest) -> bool:
    """Add what ``index`` holds of ``manifest``; whether it is a whole copy of its part (False: some of it
    is no copy; an index of another save is ignored)."""
    files = manifest.header.files
    whole = index.file in files and files[index.file] == index.durable_bytes
    if index.durable_bytes and not whole:
        return True  # a file of another save
    if whole:
        found.files.add(index.file)
    found.sizes[index.file] = index.local_bytes
    matched, required = 0, sum(extra.offset >= index.durable_bytes for extra in index.extras)
    for extra in index.extras:
        key = MetadataIndex(extra.fqn, torch.Size(extra.chunk_offset) if extra.chunk_offset is not None else None)
        record = manifest.items.get(key)
        if record is None or record.inline is not None or _fingerprint(record) != (extra.crc32c, extra.stored_lengths):
            continue
        if extra.offset + record.stored_bytes > index.local_bytes:
            continue
        found.relocated.setdefault(key, _relocated(record, index.file, extra.offset))
        matched += extra.offset >= index.durable_bytes  # a copy in the durable part: the file holds it anyway
    if matched == required and (whole or matched):
        found.complete_ranks.add(parse_data_file_name(index.file).rank)
        return True
    return False


def _relocated(record: StoredItem, file: str, offset: int) -> StoredItem:
    """``record``'s blocks where a fast-tier file holds them back to back (a reference of an incremental
    save becomes a plain record there)."""
    plain = {field.name: getattr(record, field.name) for field in dataclasses.fields(StoredItem)}
    return StoredItem(**{**plain, "file": file, "offset": offset})


def damaged_blocks(local: FsspecStore, file: str, manifest: Manifest, copies: LocalCopies) -> str | None:
    """What is wrong with the fast-tier file ``file``, checked as a load would check it: every block the
    checkpoint stores there (its durable part) or relocated there (replicas) against its CRC32C; ``None``
    when every block is whole."""
    blocks = placed_blocks([*manifest.records(), *copies.relocated.values()], file, manifest.extents)
    return first_damage(local.path(file), blocks)


def index_damage(path: str, index: HeldIndex) -> str | None:
    """What is wrong with the file at ``path`` against its held ``index``: its size, and every block of
    every item the index lists, against its CRC32C; ``None`` when the file is what the index describes.
    (A partner's copy is checked so on arrival, before any manifest is at hand.)"""
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        return f"it cannot be read: {exc}"
    if size != index.local_bytes:
        return f"it holds {size} bytes, its index records {index.local_bytes}"
    return first_damage(path, blocks_of(index))


def blocks_of(index: HeldIndex) -> list[tuple[int, int, int]]:
    """``(offset, length, CRC32C)`` of every block of every item ``index`` lists, by offset; ``ValueError``
    when an entry is malformed."""
    blocks = []
    for item in index.extras:
        crcs = np.frombuffer(base64.b64decode(item.crc32c), dtype="<u4")
        lengths = np.frombuffer(base64.b64decode(item.stored_lengths), dtype="<u4")
        if len(crcs) != len(lengths):
            raise ValueError(f"the entry of {item.fqn!r} lists {len(crcs)} CRC32Cs for {len(lengths)} blocks")
        starts = item.offset + np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)])
        blocks.extend(zip(starts.tolist(), lengths.tolist(), crcs.tolist(), strict=True))
    return sorted(blocks)


def first_damage(path: str, blocks: list[tuple[int, int, int]]) -> str | None:
    """The first of ``blocks`` (``(offset, length, CRC32C)``) the file at ``path`` does not hold, said
    in words; ``None`` when it holds them all. The file is mapped, not read: its blocks are checked where
    the page cache holds them."""
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if not size or not blocks:
                return None if not blocks else f"it ends before byte {blocks[0][0] + blocks[0][1]}"
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
                for offset, length, crc in blocks:
                    if offset + length > size:
                        return f"it ends before byte {offset + length}"
                    if checksum(view[offset : offset + length]) != crc:
                        return f"the block at byte {offset} fails its CRC32C"
    except (OSError, ValueError) as exc:
        return f"it cannot be read: {exc}"
    return None


def holds_committed(local_step: str, manifest: Manifest) -> bool | None:
    """Whether the node's copy in folder ``local_step`` is the checkpoint ``manifest`` describes (its
    ``ckptio.json`` has the same save id, or a data file of its is one the checkpoint names: ``True``), a
    copy of a checkpoint that ``manifest``'s superseded (every file of it older than that commit:
    ``False``), or neither, so possibly newer than the commit (a save whose drain has not committed:
    ``None``)."""
    names = _files_below(local_step)
    own = os.path.join(local_step, METADATA_NAME)
    if own in names:
        try:
            with open(own, "rb") as f:
                if decode_metadata(f.read(), own).header.save_id == manifest.header.save_id:
                    return True
        except (OSError, CheckpointError):
            pass
    for name in names:
        if name.endswith(HELD_SUFFIX):
            held = os.path.relpath(name, local_step)[: -len(HELD_SUFFIX)].replace(os.sep, "/")
            if held in manifest.header.files:
                return True
    try:
        newest = max(os.stat(name).st_mtime for name in names) if names else 0.0
    except OSError:
        return None
    return False if newest < manifest.header.created_unix else None


def _files_below(folder: str) -> list[str]:
    """The copy's files in ``folder`` (not what the node noted beside it: ``node_notes``)."""
    return [os.path.join(top, name) for top, _, files in os.walk(folder) for name in files if not is_note(name)]
