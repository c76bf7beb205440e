"""Checkpoints of ckptio 0.x, kept apart from the 1.0 path: format versions 1 and 2 (a JSON object per
item, ``v1``) and 3 to 7 (per-key records and tables, ``v3``, ``v3_decode``), read into the same
``Manifest`` a 1.0 document gives, so that they load. Nothing writes them (``encode_legacy`` exists for
the tests of this reader); a 0.x fragment of a save without a coordinator is refused (``document``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ckptio.errors import CheckpointFormatError
from ckptio.format.decode import decode_extents, decode_files
from ckptio.format.fragments import FRAGMENT_FIELD, FragmentInfo
from ckptio.format.names import (
    SIBLING_PREFIX,
)
from ckptio.format.records import Header, Manifest, StoredItem, manifest_of, virtual_file_sizes
from ckptio.format.rules import check_planner_paths
from ckptio.format.tables import INCREMENTAL, KEY_PREFIX
from ckptio.legacy import FRAGMENT_VERSION, INCREMENTAL_VERSION, SPREAD_KEYS_VERSION
from ckptio.legacy.v1 import decode_version_1
from ckptio.legacy.v3 import encode_document
from ckptio.legacy.v3_decode import decode_keys


def encode_legacy(
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


def decode_legacy(doc: dict[str, Any], where: str, doc_bytes: int) -> Manifest:
    """A format version 1 to 7 document, parsed and its version checked (``document``)."""
    return decode_version_3(doc, where, doc_bytes) if doc["format_version"] >= 3 else decode_version_1(doc, where)


def decode_version_3(doc: dict[str, Any], where: str, doc_bytes: int) -> Manifest:
    version = doc["format_version"]
    if doc.get("chain") is not None and version < INCREMENTAL_VERSION:
        raise CheckpointFormatError(f"{where}: 'chain' is format version {INCREMENTAL_VERSION}'s")
    if doc.get("extents") is not None and version < INCREMENTAL_VERSION:
        raise CheckpointFormatError(f"{where}: extents: an object of format version {INCREMENTAL_VERSION} and later")
    names, sizes, writers = decode_files(doc.get("files"), _features_of(version), where)
    files = dict(zip(names, sizes, strict=True))
    header = Header.from_json(doc, where, checked_files=(files, writers))
    extents = decode_extents(doc.get("extents"), names, sizes, doc_bytes, where)
    if extents:  # items stored in pieces name their virtual files after the data files
        names += tuple(extents)
        files = {**files, **virtual_file_sizes(extents)}
    state, items, per_rank, paths = decode_keys(doc, names, files, doc_bytes, where)
    if doc.get("planner_data") != "paths":  # stored as it is
        paths = check_planner_paths(doc.get("planner_data"), len(state), where)
    return manifest_of(header, state, items, per_rank, paths, extents)


def _features_of(version: int) -> frozenset[str]:
    """What a 0.x version had that 1.0 declares as features: key prefixes from 5, sibling files from 7."""
    return frozenset(
        feature
        for feature, since in ((KEY_PREFIX, SPREAD_KEYS_VERSION), (INCREMENTAL, INCREMENTAL_VERSION))
        if version >= since
    )
