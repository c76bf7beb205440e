"""What a checkpoint holds (``inspect``), whether every byte of it is intact (``verify``), what
unfinished saves left beside it (``gc``), and removing it whole."""

from __future__ import annotations

import dataclasses
import datetime
from collections import defaultdict
from typing import Any, Callable

from torch.distributed.checkpoint.metadata import MetadataIndex

from ckptio.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError
from ckptio.format.records import (
    METADATA_NAME,
    TORCH_DCP_METADATA_NAME,
    ItemKind,
    Manifest,
    StoredItem,
    dtype_name,
    is_data_file_name,
    legacy_document,
    parse_data_file_name,
)
from ckptio.loading.fetch import read_item_blocks
from ckptio.loading.reader import file_size_problems, read_manifest
from ckptio.storage import FsspecStore, open_store


def describe(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything ``ckptio inspect`` prints, as one JSON-ready dict."""
    _, manifest = open_checkpoint(url, storage_options)
    header = manifest.header
    by_key: dict[str, list[StoredItem]] = defaultdict(list)
    for index, item in every_item(manifest):
        by_key[index.fqn].append(item)
    keys = []
    for fqn, md in sorted(manifest.metadata.state_dict_metadata.items()):
        items = by_key.get(fqn, [])
        stored = sum(i.stored_bytes for i in items)
        logical = sum(i.logical_bytes for i in items)
        is_tensor = hasattr(md, "chunks")
        keys.append(
            {
                "key": fqn,
                "type": ItemKind.TENSOR.value if is_tensor else "object",
                "dtype": dtype_name(md.properties.dtype) if is_tensor else None,
                "shape": list(md.size) if is_tensor else None,
                "chunks": len(md.chunks) if is_tensor else len(items),
                "stored_bytes": stored,
                "logical_bytes": logical,
                "files": sorted({i.file for i in items}),
                "compression_ratio": round(logical / stored, 3) if stored else 1.0,
            }
        )
    stored_total = sum(k["stored_bytes"] for k in keys)
    logical_total = sum(k["logical_bytes"] for k in keys)
    return {
        "url": url,
        "written_by": header.written_by,
        "format_version": header.format_version,
        "created": datetime.datetime.fromtimestamp(header.created_unix, datetime.timezone.utc).isoformat(),
        "save_id": header.save_id,
        "world_size": header.world_size,
        "mesh": header.mesh.to_json() if header.mesh else None,
        "mode": header.config.mode,
        "compression": header.config.compression,
        "files": manifest.files,
        "writer_ranks": dict(header.writer_ranks),
        "stored_bytes": stored_total,
        "logical_bytes": logical_total,
        "compression_ratio": round(logical_total / stored_total, 3) if stored_total else 1.0,
        "keys": keys,
        # the metadata itself, one JSON object per item (version 3 stores it as packed columns)
        "metadata": legacy_document(manifest),
    }


def every_item(manifest: Manifest) -> list[tuple[MetadataIndex, StoredItem]]:
    """Every stored item, per-rank copies of objects included (those are under ``MetadataIndex(key, index=rank)``)."""
    items = list(manifest.items.items())
    for fqn, copies in manifest.per_rank.items():
        seen = {(item.file, item.offset) for index, item in items if index.fqn == fqn}
        items += [(MetadataIndex(fqn, index=r), c) for r, c in copies.items() if (c.file, c.offset) not in seen]
    return items


def format_description(desc: dict[str, Any]) -> str:
    lines = [
        f"checkpoint   {desc['url']}",
        f"written by   {desc['written_by']} (format {desc['format_version']}) at {desc['created']}",
        f"saved on     {desc['world_size']} ranks"
        + (f", mesh {_mesh(desc['mesh'])}" if desc.get("mesh") else "")
        + f", mode {desc['mode']}, compression {desc['compression'] or 'none'}",
        f"files        {len(desc['files'])} data files, {_size(desc['stored_bytes'])} stored, "
        f"{_size(desc['logical_bytes'])} logical (ratio {desc['compression_ratio']})",
    ]
    for name, size in sorted(desc["files"].items()):
        lines.append(f"  {name}  {_size(size)}  written by rank {desc['writer_ranks'].get(name, '?')}")
    header = ("key", "dtype", "shape", "chunks", "stored", "logical", "ratio", "files")
    rows = [
        (
            k["key"],
            k["dtype"] or "object",
            "x".join(map(str, k["shape"])) if k["shape"] is not None else "-",
            str(k["chunks"]),
            _size(k["stored_bytes"]),
            _size(k["logical_bytes"]),
            str(k["compression_ratio"]),
            ",".join(f"{parse_data_file_name(f).rank:05d}" if f else "inline" for f in k["files"]),
        )
        for k in desc["keys"]
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines.append("")
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def open_checkpoint(url: str, storage_options: dict[str, Any] | None = None) -> tuple[FsspecStore, Manifest]:
    store = open_store(url, storage_options)
    return store, read_manifest(store)


def orphaned_files(store: FsspecStore, manifest: Manifest | None) -> list[str]:
    """Data files beside the checkpoint that it does not use (left by saves that never committed);
    every data file where nothing has committed (``manifest`` None)."""
    used = manifest.files if manifest is not None else {}
    return [n for n in store.list_names() or [] if is_data_file_name(n) and n not in used]


@dataclasses.dataclass
class Garbage:
    """What saves that never committed left at a checkpoint location."""

    files: list[str]
    uploads: list[tuple[str, str]]  # (object name, upload id) of unfinished multipart uploads


def find_garbage(store: FsspecStore) -> Garbage:
    """Orphaned data files and unfinished uploads at ``store``'s location. If a save to this
    location is running right now, its files and uploads are listed too."""
    try:
        manifest: Manifest | None = read_manifest(store)
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        manifest = None
    uploads = [(name, upload_id) for name, upload_id in store.open_uploads() if is_data_file_name(name)]
    return Garbage(orphaned_files(store, manifest), uploads)


def collect_garbage(store: FsspecStore, garbage: Garbage) -> dict[str, str]:
    """Abort the uploads and delete the files of ``garbage``; return what could not be removed
    (``{description: cause}``, empty when everything went): a refused delete is reported, not logged."""
    failed: dict[str, str] = {}
    for name, upload_id in garbage.uploads:
        try:
            store.abort_upload(name, upload_id)
        except CheckpointError as exc:
            failed[f"upload {upload_id} of {store.describe(name)}"] = str(exc)
    for name in garbage.files:
        try:
            store.remove(name)
        except CheckpointError as exc:
            failed[store.describe(name)] = str(exc)
    return failed


#: The file whose presence makes a folder a loadable checkpoint -> the format it is in.
COMMIT_MARKERS = {METADATA_NAME: "ckptio", TORCH_DCP_METADATA_NAME: "torch_dcp", "model.safetensors.index.json": "hf"}


def checkpoint_format(store: FsspecStore) -> str | None:
    """``"ckptio"``, ``"torch_dcp"`` or ``"hf"`` for a committed checkpoint at ``store``; ``None``
    if nothing there is loadable (absent, or a save that never committed)."""
    return next((name for marker, name in COMMIT_MARKERS.items() if store.exists(marker)), None)


def delete_checkpoint(store: FsspecStore) -> None:
    """Remove the checkpoint at ``store`` completely. Its commit marker goes first, so a deletion
    cut short leaves an uncommitted folder (never loadable, cleaned by ``gc``), not a committed
    one with files missing; then every object under it and any unfinished multipart upload."""
    for marker in COMMIT_MARKERS:
        store.remove(marker)
    for name, upload_id in store.open_uploads():
        store.abort_upload(name, upload_id)
    store.remove_all()


def verify(store: FsspecStore, manifest: Manifest, progress: Callable[[int], None] | None = None) -> list[str]:
    """Read every stored block, check sizes and checksums; return the problems found (empty = intact)."""
    bad_files = file_size_problems(store, manifest)
    problems = [f"{store.describe(name)}: {problem}" for name, problem in bad_files.items()]
    for index, item in sorted(every_item(manifest), key=lambda kv: (kv[1].file, kv[1].offset)):
        where = f"key {index.fqn!r}" + (f" chunk {tuple(index.offset)}" if index.offset is not None else "")
        where += f" (rank {index.index}'s copy)" if index.offset is None and index.index is not None else ""
        if item.file in bad_files:
            problems.append(f"{where}: stored in missing or truncated file {item.file}")
            continue
        try:
            for _ in read_item_blocks(store, item, f"{where} in {store.describe(item.file)}"):
                pass
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
        except CheckpointError as exc:
            problems.append(f"{where}: {exc}")
        if progress:
            progress(item.stored_bytes)
    return problems


def _mesh(mesh: dict) -> str:
    shape = "x".join(str(n) for n in mesh["shape"])
    return f"{shape} ({', '.join(mesh['dims'])})" if mesh.get("dims") else shape


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
