"""Export a checkpoint's tensors to Hugging Face safetensors shards, in one process or on N ranks.

The shard plan is a pure function of the metadata (keys sorted, packed greedily up to the
shard size), so every rank computes the same plan and rank ``r`` of ``N`` writes shards
``r, r + N, ...``: the result is byte-identical to a one-process export. Each shard's tensors are
assembled from the stored chunks through the verified read path (``loading/fetch.py``: only the chunks
that shard needs, every block checked), then streamed into the shard file in the safetensors
layout (8-byte little-endian header length, JSON header, raw little-endian row-major bytes), so
one shard plus the reader's bounded read-ahead is all that is held in memory.

Example::

    ckptio.export_safetensors("s3://bucket/run/step-100", "out/", keys="model.", max_shard_size="5GB")
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ckptio.errors import CheckpointError
from ckptio.format.records import Manifest
from ckptio.hf.format import DTYPE_NAMES, INDEX_NAME
from ckptio.loading.extents import byte_source, recorded_sizes
from ckptio.loading.fetch import load_items
from ckptio.loading.reader import Reader, check_file_sizes
from ckptio.storage import FsspecStore, open_store
from ckptio.version import __version__

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*$", re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB`` (decimal, as Hugging Face counts), ``2GiB``, ``500MB`` or an int."""
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE.match(str(size))
        if not match:
            raise ValueError(f"cannot read shard size {size!r}; write it like 5GB, 500MB, 2GiB or a byte count")
        number, unit, binary = match.groups()
        base = 1024 if binary else 1000
        value = int(float(number) * base ** "_KMGT".index(unit.upper() or "_"))
    if value <= 0:
        raise ValueError(f"the shard size must be positive, got {size!r}")
    return value


@dataclasses.dataclass(frozen=True)
class ExportedTensor:
    key: str  # the key in the checkpoint
    name: str  # the name in the safetensors file (prefix removed)
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(manifest: Manifest, keys: str | None, max_shard_size: int) -> list[list[ExportedTensor]]:
    """The tensors under prefix ``keys``, sorted by name and packed greedily into shards of at most
    ``max_shard_size`` bytes (a larger tensor gets a shard of its own)."""
    tensors = []
    for key, md in manifest.metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata) or (keys and not key.startswith(keys)):
            continue
        name = key[len(keys) :] if keys else key
        if md.properties.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"key {key!r} is {md.properties.dtype}, which safetensors cannot hold")
        tensors.append(ExportedTensor(key, name, md.properties.dtype, tuple(md.size)))
    if not tensors:
        raise CheckpointError(f"no tensors under the prefix {keys!r} to export" if keys else "no tensors to export")
    tensors.sort(key=lambda t: t.name)
    shards: list[list[ExportedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def export_safetensors(
    checkpoint_id: str | os.PathLike,
    output: str | os.PathLike,
    *,
    keys: str | None = None,
    max_shard_size: int | str = "5GB",
    storage_options: dict[str, Any] | None = None,
    output_storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
) -> list[str]:
    """Write the checkpoint's tensors (those under prefix ``keys``, prefix removed) as safetensors
    shards plus ``model.safetensors.index.json`` in ``output`` (a path or fsspec URL); return the
    shard names this process wrote. Called on every rank of ``process_group`` (when a process
    group is initialised), the ranks share the shards."""
    reader = Reader(checkpoint_id, storage_options=storage_options)
    manifest = reader.prefetch_metadata()
    # Each shard's tensors are allocated whole before their bytes are read: first check that the data
    # files hold what the metadata claims, so a crafted shape cannot make an export allocate beyond them.
    check_file_sizes(reader._open_store(), manifest)
    shards = plan_shards(manifest, keys, parse_size(max_shard_size))
    rank, world = (
        (dist.get_rank(process_group), dist.get_world_size(process_group)) if dist.is_initialized() else (0, 1)
    )
    out = open_store(output, output_storage_options)
    out.prepare_directory()
    written = []
    source = {"format": "pt", "written_by": f"ckptio {__version__}", "source": os.fspath(checkpoint_id)}
    for index in range(rank, len(shards), world):
        tensors = _assemble(reader, manifest, shards[index])
        _write_shard(out, shard_name(index, len(shards)), shards[index], tensors, source)
        written.append(shard_name(index, len(shards)))
        del tensors
    if world > 1:
        dist.barrier(process_group)
    if rank == 0:
        weight_map = {t.name: shard_name(i, len(shards)) for i, shard in enumerate(shards) for t in shard}
        index_doc = {
            "metadata": {"total_size": sum(t.nbytes for s in shards for t in s), **source},
            "weight_map": weight_map,
        }
        out.put_atomic(INDEX_NAME, json.dumps(index_doc, indent=2, sort_keys=True).encode())
    return written


class _AssemblyPlanner:
    """What ``fetch.load_items`` needs of a load planner: each stored chunk lands in its place in
    the full tensor (a view; staged copies write through it)."""

    def __init__(self, full: dict[str, torch.Tensor]):
        self.full = full

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        tensor = self.full[read_item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            tensor = tensor.narrow(dim, offset, length)
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # written in place


def _assemble(reader: Reader, manifest: Manifest, shard: list[ExportedTensor]) -> dict[str, torch.Tensor]:
    full = {t.key: torch.empty(t.shape, dtype=t.dtype) for t in shard}
    pairs = []
    for tensor in shard:
        for chunk in manifest.metadata.state_dict_metadata[tensor.key].chunks:
            index = MetadataIndex(tensor.key, chunk.offsets)
            read_item = ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=index,
                dest_offsets=chunk.offsets,
                storage_index=index,
                storage_offsets=torch.Size([0] * len(chunk.offsets)),
                lengths=chunk.sizes,
            )
            pairs.append((read_item, manifest.items[index]))
    store = byte_source(reader._open_store(), manifest)
    load_items(
        store, pairs, _AssemblyPlanner(full), True, recorded_sizes(manifest), reader.storage_config.max_concurrency
    )
    return full


def _write_shard(
    out: FsspecStore,
    name: str,
    shard: list[ExportedTensor],
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
) -> None:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for t in shard:
        header[t.name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    sink = out.open_sink(name)
    try:
        sink.write(len(encoded).to_bytes(8, "little") + encoded)
        for t in shard:
            data = tensors[t.key].contiguous().reshape(-1).view(torch.uint8).numpy()
            if data.size:
                sink.write(memoryview(data).cast("B"))
        sink.close()
    except BaseException:
        sink.abort()
        raise
