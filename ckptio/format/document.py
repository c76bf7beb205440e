"""The metadata document's one way in and out: every save encodes, and every load, tool and tier decodes,
through here. ckptio 1.0 writes and reads format version 8 (``tables``); a checkpoint of ckptio 0.x is
read by ``legacy`` (kept apart: nothing of it is on the 1.0 path); a newer version asks for an upgrade.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ckptio.errors import CheckpointFormatError
from ckptio.format.decode import decode_documents, decode_tables, schema_errors_named
from ckptio.format.encode import encode, tables_of
from ckptio.format.fragments import FragmentInfo
from ckptio.format.merge import merge_tables
from ckptio.format.names import FORMAT_NAME, FORMAT_VERSION
from ckptio.format.records import Header, Manifest, StoredItem
from ckptio.format.tables import FRAGMENT, Tables
from ckptio.format.view import manifest_of_tables
from ckptio.gc_pause import paused_gc


def encode_metadata(
    metadata: Metadata,
    items: Mapping[tuple[str, Any], StoredItem],
    header: Header,
    per_rank: Mapping[str, Mapping[int, StoredItem]] | None = None,
    fragment: FragmentInfo | None = None,
) -> bytes:
    """A save's metadata document: DCP's metadata, ckptio's record of each ``(key, chunk offsets or
    None)``, the header, the objects kept per rank; with ``fragment``, a rank's fragment of a save
    without a coordinator."""
    return encode(tables_of(metadata, items, per_rank or {}, header, fragment))


@paused_gc()
def decode_metadata(raw: bytes, where: str) -> Manifest:
    doc = parse_json(raw, where)
    if _version(doc, where) < FORMAT_VERSION:
        from ckptio.legacy.reader import decode_legacy  # 0.x's, kept apart

        return _schema_checked(decode_legacy, doc, where, len(raw))
    tables = _decode(doc, where, len(raw))
    if FRAGMENT in tables.features:
        raise CheckpointFormatError(
            f"{where} is a rank's fragment of a save without a coordinator, not a checkpoint's metadata"
        )
    return manifest_of_tables(tables)


@paused_gc()
def decode_fragment(raw: bytes, where: str) -> tuple[Manifest, FragmentInfo]:
    """A rank's fragment of a save without a coordinator: its items, and whose and which save's it is."""
    tables = _fragment_tables(raw, where)
    return manifest_of_tables(tables), tables.fragment  # type: ignore[return-value]


@paused_gc()
def merge_fragments(fragments: Iterable[tuple[str, bytes]], ranks: int, where: str) -> bytes:
    """The metadata document of a save without a coordinator, from its ``ranks`` fragments ((name, bytes)
    pairs, or a name -> bytes mapping, of a complete set by name: ``fragments.check_set``). Each fragment
    is checked, and what joining them needs; what the joined document shows (tensors covered, paths) is
    checked where every caller decodes it, as any ``ckptio.json`` (``decode_metadata``: a load on every
    rank, ``ckptio merge`` before it commits): checking it here too took a tenth of a merge at 8,192
    fragments. Fragments are decoded ``MERGE_BATCH`` at a time (``decode_documents``), their bytes and
    parsed documents dropped once decoded (a set of 8,192 is ~36 MB of JSON)."""
    pairs = iter(fragments.items() if isinstance(fragments, Mapping) else fragments)
    shared: dict[Any, Any] = {}
    decoded = []
    while batch := list(itertools.islice(pairs, MERGE_BATCH)):
        docs = [(_fragment_document(raw, f"{where}/{n}"), f"{where}/{n}", len(raw)) for n, raw in batch]
        tables = decode_documents(docs, cover=False, decode_paths=False)
        for (name, _), (_, read_from, _), fragment in zip(batch, docs, tables, strict=True):
            decoded.append((name, read_from, _compact(_a_fragment(fragment, read_from, FORMAT_VERSION), shared)))
    if len(decoded) != ranks:
        raise ValueError(f"merge_fragments takes the {ranks} fragments of a complete set, got {len(decoded)}")
    try:
        return encode(merge_tables(decoded, where))
    except ValueError as exc:  # the fragments' data file names mix key-prefix rules
        raise CheckpointFormatError(f"{where}: its fragments cannot form one checkpoint: {exc}") from None


#: Fragments a merge decodes together: their parsed documents are held until then (~40 KB each).
MERGE_BATCH = 256


def _fragment_tables(raw: bytes, where: str) -> Tables:
    tables = _decode(_fragment_document(raw, where), where, len(raw), cover=False)
    return _a_fragment(tables, where, FORMAT_VERSION)


def _fragment_document(raw: bytes, where: str) -> dict[str, Any]:
    """A fragment's parsed document, of the 1.0 format."""
    doc = parse_json(raw, where)
    version = _version(doc, where)
    if version != FORMAT_VERSION:
        _a_fragment(None, where, version)
    return doc


def _a_fragment(tables: Tables | None, where: str, version: int) -> Tables:
    """``tables`` when they are a 1.0 fragment's (``None``: a document of another version)."""
    if tables is None or FRAGMENT not in tables.features:
        raise CheckpointFormatError(
            f"{where} is not a ckptio 1.0 fragment (format version {version}, features "
            f"{sorted(tables.features) if tables else '-'}): a save without a coordinator by ckptio 0.x does not "
            "load in 1.0; load it with the ckptio that wrote it and save it again"
        )
    return tables


def _compact(tables: Tables, shared: dict[Any, Any]) -> Tables:
    """A fragment's tables as a merge keeps them until the set is joined: its checksums as an array (not
    the document's base64 text), its paths as codes (not decoded again), and the key names, path codes
    and shapes every fragment repeats held once for all (``shared``: 8,192 fragments of FSDP kept ~11 KB
    each of them, most of a merge's memory). Fragments of one save repeat a few whole lists of path codes
    (codes count a key's parts, not name them; a rank's keys differ with what it left to others): a list
    equal to one of the last ``_RECENT_PATHS_KEPT`` is that one."""
    tables.crc, tables.digests = tables.crc_array(), tables.digest_array()
    tables.names = [shared.setdefault(name, name) for name in tables.names]
    tables.shapes = [shared.setdefault(shape, shape) for shape in tables.shapes]
    if tables.paths is not None:
        recent = shared.setdefault(_RECENT_PATHS, [])
        same = next((codes for codes in recent if codes == tables.paths), None)
        if same is None:
            same = [None if code is None else shared.setdefault(tuple(code), code) for code in tables.paths]
            recent[:] = [same, *recent[: _RECENT_PATHS_KEPT - 1]]
        tables.paths = same
    return tables


_RECENT_PATHS, _RECENT_PATHS_KEPT = object(), 8  # ``_compact``'s key for the recent lists of path codes


def _decode(doc: dict[str, Any], where: str, doc_bytes: int, cover: bool = True) -> Tables:
    return _schema_checked(decode_tables, doc, where, doc_bytes, cover)


def _schema_checked(decode: Callable[..., Any], doc: dict[str, Any], where: str, *args: Any) -> Any:
    """``decode(doc, where, *args)``, a document of the wrong shape a named format error."""
    with schema_errors_named(where):
        return decode(doc, where, *args)


def _version(doc: Any, where: str) -> int:
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
    return version


def parse_json(raw: bytes, where: str) -> Any:
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
