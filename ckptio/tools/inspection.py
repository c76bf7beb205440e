"""``ckptio inspect``: what a checkpoint holds (world size, mesh, mode, files, every key), as a
JSON-ready dict and as text."""

from __future__ import annotations

import base64
import datetime
import os
from collections import defaultdict
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from ckptio.errors import CheckpointNotFoundError, StorageError
from ckptio.format.names import (
    METADATA_NAME,
    ItemKind,
    dtype_name,
    parse_data_file_name,
    parse_reference_marker_name,
    split_sibling_file_name,
)
from ckptio.format.records import Manifest, StoredItem
from ckptio.loading.reader import read_manifest
from ckptio.storage import FsspecStore, open_store
from ckptio.tiers.paths import local_step_path
from ckptio.tools.tier_status import node_copy


def describe(url: str, storage_options: dict[str, Any] | None = None, local_tier: str | None = None) -> dict[str, Any]:
    """Everything ``ckptio inspect`` prints, as one JSON-ready dict; with ``local_tier``, also this
    node's fast-tier copy (``tiers``), which describes a checkpoint not yet committed durably."""
    tiers = None
    committed_by = "coordinator"
    try:
        store, manifest = open_checkpoint(url, storage_options)
        durable: bool | str = True
        if not store.exists(METADATA_NAME):
            committed_by = "fragments"
    except (CheckpointNotFoundError, StorageError) as exc:
        node_copy_path = local_step_path(local_tier, url, storage_options) if local_tier else None
        if node_copy_path is None or not os.path.exists(os.path.join(node_copy_path, METADATA_NAME)):
            raise
        store, manifest = open_checkpoint(node_copy_path)
        durable = False if isinstance(exc, CheckpointNotFoundError) else f"unreachable ({exc})"
    if local_tier is not None:
        tiers = {"durable_committed": durable, "node": node_copy(url, local_tier, storage_options)}
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
                "files": sorted({run.file for i in items for run in manifest.runs_of(i)}),
                "compression_ratio": round(logical / stored, 3) if stored else 1.0,
            }
        )
    stored_total = sum(k["stored_bytes"] for k in keys)
    logical_total = sum(k["logical_bytes"] for k in keys)
    referenced: dict[str, int] = defaultdict(int)  # sibling -> stored bytes of this checkpoint's items there
    for items in by_key.values():
        for item in items:
            for run in manifest.runs_of(item):
                sibling, _ = split_sibling_file_name(run.file)
                if sibling is not None:
                    referenced[sibling] += run.length
    return {
        "url": url,
        "written_by": header.written_by,
        "format_version": header.format_version,
        "features": list(header.features),
        "created": datetime.datetime.fromtimestamp(header.created_unix, datetime.timezone.utc).isoformat(),
        "save_id": header.save_id,
        "world_size": header.world_size,
        # "fragments": saved without a coordinator, each rank's fragment (no ckptio.json: merged on load)
        "committed_by": committed_by,
        "mesh": header.mesh.to_json() if header.mesh else None,
        "mode": header.config.mode,
        "compression": header.config.compression,
        "files": manifest.files,
        "writer_ranks": dict(header.writer_ranks),
        "stored_bytes": stored_total,
        "logical_bytes": logical_total,
        "compression_ratio": round(logical_total / stored_total, 3) if stored_total else 1.0,
        # an incremental save's: the stored bytes in its own files, and those it references in siblings
        "owned_bytes": stored_total - sum(referenced.values()),
        "referenced_bytes": dict(sorted(referenced.items())),
        "chain": header.chain.to_json() if header.chain else None,
        # the incremental checkpoints beside it that reference its files (their markers here)
        "referenced_by": sorted(set(filter(None, map(parse_reference_marker_name, store.list_names() or [])))),
        "keys": keys,
        "tiers": tiers,
        # the metadata itself, one JSON object per key and per stored item (the document stores columns)
        "metadata": readable_metadata(manifest),
    }


def readable_metadata(manifest: Manifest) -> dict[str, Any]:
    """DCP's entry of every key (a tensor's chunks) and ckptio's record of every stored item, per-rank
    copies of objects under their rank (``index``), blocks as ``[stored length, CRC32C]`` pairs."""
    state: dict[str, Any] = {}
    for fqn, md in manifest.metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            state[fqn] = {"type": ItemKind.BYTES.value}
            continue
        state[fqn] = {
            "type": ItemKind.TENSOR.value,
            "dtype": dtype_name(md.properties.dtype),
            "size": list(md.size),
            "requires_grad": bool(md.properties.requires_grad),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    items = [
        {
            "fqn": index.fqn,
            "chunk_offset": list(index.offset) if index.offset is not None else None,
            "index": index.index,
            "file": item.file,
            "offset": item.offset,
            "logical_bytes": item.logical_bytes,
            "kind": item.kind.value,
            "dtype": item.dtype,
            "shape": list(item.shape) if item.shape is not None else None,
            "codec": item.codec.value,
            "block_size": item.block_size,
            "blocks": [list(block) for block in item.blocks],
            **({"inline": base64.b64encode(item.inline).decode()} if item.inline is not None else {}),
        }
        for index, item in every_item(manifest)
    ]
    return {"state": state, "items": items}


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
        f"written by   {desc['written_by']} (format {desc['format_version']}"
        + "".join(f", {feature}" for feature in desc.get("features", []))
        + f") at {desc['created']}",
        f"saved on     {desc['world_size']} ranks"
        + (f", mesh {_mesh(desc['mesh'])}" if desc.get("mesh") else "")
        + f", mode {desc['mode']}, compression {desc['compression'] or 'none'}"
        + (
            ", without a coordinator (one fragment per rank, merged on load)"
            if desc.get("committed_by") == "fragments"
            else ""
        ),
        f"files        {len(desc['files'])} data files, {_size(desc['stored_bytes'])} stored, "
        f"{_size(desc['logical_bytes'])} logical (ratio {desc['compression_ratio']})",
    ]
    for name, size in sorted(desc["files"].items()):
        lines.append(f"  {name}  {_size(size)}  written by rank {desc['writer_ranks'].get(name, '?')}")
    if desc.get("referenced_bytes") or desc.get("referenced_by"):
        lines.append(
            f"incremental  owns {_size(desc['owned_bytes'])}; references "
            + (", ".join(f"{_size(n)} in {sibling}" for sibling, n in desc["referenced_bytes"].items()) or "nothing")
            + (
                f" (chain depth {desc['chain']['depth']}, saved against {desc['chain']['base']})"
                if desc["chain"]
                else ""
            )
        )
        if desc.get("referenced_by"):
            lines.append(f"  referenced by {', '.join(desc['referenced_by'])}: deletes keep the files they use")
    if desc.get("tiers"):
        lines += _tier_lines(desc["tiers"])
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
            ",".join(_file_label(f) for f in k["files"]),
        )
        for k in desc["keys"]
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines.append("")
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _file_label(name: str) -> str:
    """A data file as the key table shows it: its rank, after its folder when a sibling holds it."""
    if not name:
        return "inline"
    sibling, own = split_sibling_file_name(name)
    rank = f"{parse_data_file_name(own).rank:05d}"
    return f"{sibling}:{rank}" if sibling else rank


def _tier_lines(tiers: dict[str, Any]) -> list[str]:
    node = tiers["node"]
    durable = tiers["durable_committed"]
    if durable is True:
        durable = "committed"
    else:
        durable = f"{durable or 'NOT committed yet'} (described from this node's copy)"
    lines = [f"durable tier {durable}"]
    if not node["present"]:
        return lines + [f"fast tier    this node holds no copy ({node['path']})"]
    here = "holds the metadata" if node["committed_here"] else "holds no metadata (another node's coordinator does)"
    ranks = sorted({f["rank"] for f in node["files"] if "rank" in f})
    held = f"of rank(s) {', '.join(map(str, ranks))}" if ranks else "of no rank"
    lines.append(f"fast tier    {node['path']}: {len(node['files'])} file(s) {held} (its own, and copies), {here}")
    uploaded = {True: "uploaded", False: "NOT uploaded", None: "durable tier unreachable"}
    for f in node["files"]:
        if "local_bytes" not in f:
            lines.append(f"  {f['file']}  {f['problem']}")
            continue
        lines.append(
            f"  {f['file']}  rank {f['rank']}, {_size(f['local_bytes'])} here, "
            f"{_size(f['durable_bytes'])} for the durable tier "
            f"({uploaded[f['on_durable']] if f['durable_bytes'] else 'nothing to upload'}), "
            f"{f['replicas']} replica item(s)" + (f"; {f['problem']}" if "problem" in f else "")
        )
    return lines


def open_checkpoint(url: str, storage_options: dict[str, Any] | None = None) -> tuple[FsspecStore, Manifest]:
    store = open_store(url, storage_options)
    return store, read_manifest(store)


def _mesh(mesh: dict) -> str:
    shape = "x".join(str(n) for n in mesh["shape"])
    return f"{shape} ({', '.join(mesh['dims'])})" if mesh.get("dims") else shape


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
