"""The one module that knows format versions: which one a save writes (4; 5 with spread key prefixes;
6, a rank's fragment of a save without a coordinator) and how each is read.

Version 1 (ckptio 0.1: a JSON object per item) and 2 (the same with the ``zstd-byteplanes`` codec) are
decoded by ``v1``; versions 3 (per-key columns) and 4 (whole tensors in one table as well) are encoded
by ``v3`` and decoded by ``v3_decode``. Both
apply the same rules (``rules``) and build the same records (``records``). A newer version than this
ckptio knows is refused asking for an upgrade.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ckptio.errors import CheckpointFormatError
from ckptio.format.fragment_columns import merge_columns
from ckptio.format.fragments import FRAGMENT_FIELD, Fragment, FragmentInfo, merge
from ckptio.format.names import (
    FORMAT_NAME,
    FORMAT_VERSION,
    FRAGMENT_VERSION,
    INCREMENTAL_VERSION,
    SIBLING_PREFIX,
    SPREAD_KEYS_VERSION,
)
from ckptio.format.records import Header, Manifest, StoredItem, manifest_of, virtual_file_sizes
from ckptio.format.rules import check_planner_paths
from ckptio.format.v1 import decode_version_1
from ckptio.format.v3 import encode_document
from ckptio.format.v3_decode import decode_extents, decode_files, decode_keys
from ckptio.gc_pause import paused_gc


def encode_metadata(
    metadata: Metadata,
    items: dict[tuple[str, torch.Size | None], StoredItem],
    header: Header,
    per_rank: dict[str, dict[int, StoredItem]] | None = None,
    format_version: int | None = None,
    fragment: FragmentInfo | None = None,
) -> bytes:
    """Serialize DCP metadata plus ckptio's item records, by ``(key, chunk offsets or None)``, into the
    JSON document: format version 4, or 5 where the data files are under spread key prefixes (so a
    ckptio that does not know them refuses the checkpoint instead of missing its files); 3 on request,
    for a reader that predates the ``tensors`` table. With ``fragment``: a rank's fragment of a save
    without a coordinator (``fragments.py``), version 6. An incremental save's document (data files of
    sibling checkpoints, block digests: ``incremental_from``), version 7."""
    spread = any("/" in name for name in header.files)  # the names themselves are checked by the encoder
    incremental = header.chain is not None or any(name.startswith(SIBLING_PREFIX) for name in header.files)
    if fragment is not None:
        format_version = FRAGMENT_VERSION
    elif format_version is None and (incremental or _digested(items)):
        format_version = INCREMENTAL_VERSION
    elif format_version is None:
        format_version = SPREAD_KEYS_VERSION if spread else 4
    elif format_version not in (3, 4, 5) or (spread and format_version < SPREAD_KEYS_VERSION):
        raise ValueError(
            f"ckptio writes format versions 3 to 5, and {SPREAD_KEYS_VERSION} or later for data files under key "
            f"prefixes, not {format_version}"
        )
    block_size = header.config.max_block_size or next((i.block_size for i in items.values()), 64)
    doc = dataclasses.replace(header, format_version=format_version).to_json()
    boxed = fragment is not None
    columns = encode_document(
        metadata, items, per_rank or {}, header.files, header.writer_ranks, block_size, format_version >= 4, boxed
    )
    doc.update(columns)
    del doc["writer_ranks"]  # in 'files'
    if fragment is not None:
        doc[FRAGMENT_FIELD] = fragment.to_json()
    return _dumps(doc)


def _dumps(doc: dict[str, Any]) -> bytes:
    """A metadata document's bytes: compact JSON of a tree ckptio built (no cycle to check for)."""
    return json.dumps(doc, separators=(",", ":"), check_circular=False).encode()


def _digested(items: dict) -> bool:
    """Whether the items carry block digests (a save with ``incremental_from`` set records them)."""
    first = next(iter(items.values()), None)
    return first is not None and first.digests is not None


@paused_gc()
def decode_metadata(raw: bytes, where: str) -> Manifest:
    return _decode_document(_parse_json(raw, where), where, len(raw))


@paused_gc()
def decode_fragment(raw: bytes, where: str) -> tuple[Manifest, FragmentInfo]:
    """A rank's fragment of a save without a coordinator: its items, and whose and which save's it is."""
    doc = _parse_json(raw, where)
    manifest = _decode_document(doc, where, len(raw), cover=False)  # its rank's part of each tensor
    return manifest, FragmentInfo.from_json(doc.get(FRAGMENT_FIELD), where)


@paused_gc()
def merge_fragments(fragments: dict[str, bytes], ranks: int, where: str) -> bytes:
    """The metadata document of a save without a coordinator, from its ``ranks`` fragments (name ->
    bytes, a complete set by name: ``fragments.check_set``), for every reader to decode as it decodes
    ``ckptio.json``: merged column by column (``fragment_columns``) when every fragment is of the shape
    that merge takes, else each fragment decoded and checked, then the set (``fragments.merge``)."""
    if len(fragments) != ranks:
        raise ValueError(f"merge_fragments takes the {ranks} fragments of a complete set, got {len(fragments)}")
    parsed = ((name, f"{where}/{name}", _parse_json(raw, f"{where}/{name}")) for name, raw in fragments.items())
    doc = merge_columns(parsed, where)  # each parsed fragment dropped once read into rows
    if doc is not None:
        return _dumps(doc)
    decoded = []  # a fragment the column merge does not take: every fragment decoded into records
    for name, raw in fragments.items():
        manifest, info = decode_fragment(raw, f"{where}/{name}")
        decoded.append(Fragment(name, f"{where}/{name}", manifest, info))
    metadata, items, header, per_rank = merge(decoded, where)
    return encode_metadata(metadata, items, header, per_rank)


def _decode_document(doc: Any, where: str, doc_bytes: int, cover: bool = True) -> Manifest:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CheckpointFormatError(f"{where} is not a ckptio metadata document (no 'format': 'ckptio')")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointFormatError(f"{where} has no valid format_version (a positive integer): {version!r:.40}")
    if version > FORMAT_VERSION:
        written_by = doc.get("written_by")
        raise CheckpointFormatError(
            f"{where} was written by {written_by if isinstance(written_by, str) else 'a newer ckptio'!s:.80} in "
            f"format version {version}; this ckptio reads format versions up to {FORMAT_VERSION}: upgrade ckptio "
            "to load it"
        )
    try:
        return decode_version_3(doc, where, doc_bytes, cover) if version >= 3 else decode_version_1(doc, where)
    except CheckpointFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise CheckpointFormatError(f"{where} does not follow the ckptio metadata schema: {exc!r:.300}") from None


def _parse_json(raw: bytes, where: str) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise CheckpointFormatError(f"{where} repeats the JSON key {dup!r:.80}; the metadata is ambiguous")
        return out

    try:
        return json.loads(raw, object_pairs_hook=no_duplicates)
    except CheckpointFormatError:
        raise
    except RecursionError:  # json's C parser counts its nesting and stops cleanly
        raise CheckpointFormatError(
            f"{where} nests JSON deeper than the parser allows; it is not ckptio metadata"
        ) from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, int digit limit
        raise CheckpointFormatError(
            f"{where} is not valid JSON ({str(exc):.200}); the metadata is damaged or not a ckptio checkpoint"
        ) from None


def decode_version_3(doc: dict[str, Any], where: str, doc_bytes: int, cover: bool = True) -> Manifest:
    names, files, writers = decode_files(doc.get("files"), doc["format_version"], where)
    header = Header.from_json(doc, where, checked_files=(files, writers))
    extents = decode_extents(doc.get("extents"), names, files, doc["format_version"], doc_bytes, where)
    if extents:  # items stored in pieces name their virtual files after the data files
        names += tuple(extents)
        files = {**files, **virtual_file_sizes(extents)}
    state, items, per_rank, paths = decode_keys(doc, names, files, doc_bytes, where, cover)
    if doc.get("planner_data") != "paths":  # stored as it is
        paths = check_planner_paths(doc.get("planner_data"), len(state), where)
    return manifest_of(header, state, items, per_rank, paths, extents)
