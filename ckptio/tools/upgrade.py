"""``ckptio upgrade``: a checkpoint of ckptio 0.x (format versions 1 to 7) given ckptio 1.0's metadata, its
data files untouched, so that it loads without the 0.x reader (``ckptio.legacy``), which a later release
may drop. The new document replaces the old one only once it is proven to describe the same checkpoint:
it is decoded by the 1.0 decoder and compared with the old one key by key and record by record."""

from __future__ import annotations

import dataclasses
from typing import Any

from ckptio.errors import CheckpointFormatError
from ckptio.format.document import decode_metadata, encode_metadata
from ckptio.format.names import FORMAT_VERSION, METADATA_NAME
from ckptio.format.records import Manifest, Reference, StoredItem
from ckptio.storage import FsspecStore

_RECORD_FIELDS = ("logical_bytes", "kind", "dtype", "shape", "codec", "block_size", "blocks", "inline", "digests")


@dataclasses.dataclass(frozen=True)
class Upgrade:
    """What ``upgrade`` did: the version the checkpoint had, and the new document (None: already 1.0)."""

    old_version: int
    document: bytes | None
    old_bytes: int


def upgrade(store: FsspecStore, write: bool = True) -> Upgrade:
    """Rewrite ``store``'s ``ckptio.json`` in the 1.0 format when it is a 0.x one (``write=False``: prove
    the new document only). Raises ``CheckpointFormatError`` when the old document does not decode, or
    the new one would not describe exactly the same checkpoint (nothing is written then)."""
    where = store.describe(METADATA_NAME)
    raw = store.read(METADATA_NAME)
    old = decode_metadata(raw, where)
    version = old.header.format_version
    if version >= FORMAT_VERSION:
        return Upgrade(version, None, len(raw))
    document = encode_metadata(old.metadata, _items_of(old), old.header, old.per_rank)
    _check_same(old, decode_metadata(document, f"{where} (upgraded)"), where)
    if write:
        store.put_atomic(METADATA_NAME, document)
    return Upgrade(version, document, len(raw))


def _items_of(manifest: Manifest) -> dict[tuple[str, Any], StoredItem]:
    """The records by ``(key, chunk offsets or None)``, as a save hands them to the encoder; an item stored
    in pieces (a 0.x incremental save's) as the reference to its runs the encoder takes."""
    items = {}
    for index, record in manifest.items.items():
        runs = manifest.extents.get(record.file)
        if runs:
            fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(StoredItem)}
            record = Reference(**fields, extents=runs)
        items[(index.fqn, index.offset)] = record
    return items


def _check_same(old: Manifest, new: Manifest, where: str) -> None:
    """Every key, chunk, record (where its blocks lie included), per-rank copy and header field alike."""
    problems = []
    if old.metadata.state_dict_metadata != new.metadata.state_dict_metadata:
        problems.append("the keys or their chunks")
    if (old.metadata.planner_data or None) != (new.metadata.planner_data or None):
        problems.append("torch's planner data")
    plain = {"format_version": FORMAT_VERSION, "features": ()}
    if dataclasses.replace(old.header, **plain) != dataclasses.replace(new.header, **plain):
        problems.append("the header")
    old_records, new_records = _records(old), _records(new)
    if old_records.keys() != new_records.keys():
        problems.append("the set of stored items")
    for index in old_records.keys() & new_records.keys():
        a, b = old_records[index], new_records[index]
        if old.runs_of(a) != new.runs_of(b) or any(getattr(a, f) != getattr(b, f) for f in _RECORD_FIELDS):
            problems.append(f"the record of {index}")
            break
    if problems:
        raise CheckpointFormatError(
            f"{where}: its 1.0 metadata would differ in {', '.join(problems)}; nothing was written. Load it with "
            "this ckptio (0.x checkpoints load as they are) and report the checkpoint's ckptio.json"
        )


def _records(manifest: Manifest) -> dict[Any, StoredItem]:
    """Every record by what it stores: a key's chunk, or a rank's copy of a per-rank object (0.x also
    recorded one of the copies as the key's item; 1.0 keeps the copies only)."""
    records: dict[Any, StoredItem] = {}
    for index, record in manifest.items.items():
        copies = manifest.per_rank.get(index.fqn)
        if copies is None:
            records[(index.fqn, index.offset)] = record
        elif record not in copies.values():
            records[(index.fqn, "item")] = record  # not one of the copies: nothing to stand for it in 1.0
    for fqn, copies in manifest.per_rank.items():
        records.update(((fqn, "rank", rank), copy) for rank, copy in copies.items())
    return records
