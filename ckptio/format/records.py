"""The typed records of a checkpoint's metadata: a stored item, the header, the decoded document.

Nothing here does I/O, and nothing is ever unpickled: the metadata is JSON, and every field is
type- and range-checked before any data file is opened. The 1.0 decoder (``view``) and the 0.x
readers (``ckptio.legacy``) build the same records.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ckptio.errors import CheckpointFormatError
from ckptio.format.names import (
    FORMAT_NAME,
    FORMAT_VERSION,
    Codec,
    ItemKind,
    dtype_from_name,
    is_sibling_name,
)
from ckptio.format.rules import require_count, require_counts

# ---------------------------------------------------------------------------------------
# Records


class _cached:
    """``functools.cached_property`` without the lock it takes on every first use before Python 3.12:
    a save's coordinator reads the stored size of hundreds of thousands of records once each."""

    def __init__(self, compute: Any):
        self.compute, self.name = compute, compute.__name__

    def __get__(self, record: Any, owner: Any = None) -> Any:
        if record is None:
            return self
        value = record.__dict__[self.name] = self.compute(record)
        return value


@dataclasses.dataclass(frozen=True)
class StoredItem:
    """Where one saved item (a tensor chunk or a bytes object) lives and how to check it."""

    file: str
    offset: int
    logical_bytes: int
    kind: ItemKind
    dtype: str | None
    shape: tuple[int, ...] | None
    codec: Codec
    block_size: int
    blocks: tuple[tuple[int, int], ...]  # (stored length, crc32c) per block
    inline: bytes | None = None  # stored bytes kept inside ckptio.json (file == "")
    digests: bytes | None = None  # DIGEST_BYTES per block: the content digest of its logical bytes (incremental)

    @_cached
    def block_offsets(self) -> list[int]:
        """Absolute file offset of each block, plus the end offset as a last entry."""
        return list(itertools.accumulate((stored_len for stored_len, _ in self.blocks), initial=self.offset))

    @_cached
    def stored_bytes(self) -> int:
        return sum(stored_len for stored_len, _ in self.blocks)

    @property
    def itemsize(self) -> int:
        """Bytes per element (1 for objects)."""
        return dtype_from_name(self.dtype).itemsize if self.kind == ItemKind.TENSOR else 1

    def block_logical_len(self, index: int) -> int:
        return min(self.block_size, self.logical_bytes - index * self.block_size)


#: Bytes of a block's content digest (xxh3-128; ``codec.block_digest``).
DIGEST_BYTES = 16
#: The digest of a block that was not hashed (it changed in a row of changed blocks; ``saving/incremental.py``):
#: equal to no digest, so the block is referenced again only once a save hashes it unchanged.
NO_DIGEST = bytes(DIGEST_BYTES)


class Extent(NamedTuple):
    """A run of an item's stored blocks that lies in one data file (``file``, from ``offset``)."""

    file: str
    offset: int
    length: int

    def precedes(self, other: "Extent") -> bool:
        """Whether ``other`` starts in the same file right where this run ends."""
        return other.file == self.file and other.offset == self.offset + self.length


def virtual_file_sizes(extents: Mapping[str, tuple[Extent, ...]]) -> dict[str, int]:
    """The length of each virtual file (an item stored in pieces): its runs back to back."""
    return {name: sum(run.length for run in runs) for name, runs in extents.items()}


#: How the metadata names an item stored in pieces (``Manifest.extents``): ``~<n>``, never a data file.
VIRTUAL_PREFIX = "~"


@dataclasses.dataclass(frozen=True)
class Reference(StoredItem):
    """An item an incremental save stored at least in part in sibling checkpoints' data files:
    ``extents``, the runs of files that hold its blocks in order. With one run, ``file`` and ``offset``
    are that run's; with several, ``file`` is a virtual name (``VIRTUAL_PREFIX``) and ``offset`` 0.
    ``sibling_sizes``: the size of each sibling's file named, as its checkpoint records it."""

    extents: tuple[Extent, ...] = ()
    sibling_sizes: tuple[tuple[str, int], ...] = ()


def block_logical_lengths(logical_bytes: int, block_size: int) -> list[int]:
    """The logical length of each block of an item: full blocks, then the remainder."""
    full, rest = divmod(logical_bytes, block_size)
    return [block_size] * full + ([rest] if rest else [])


@dataclasses.dataclass(frozen=True)
class MeshRecord:
    """The device mesh a checkpoint was saved on (shown by ``ckptio inspect``)."""

    shape: tuple[int, ...]
    dims: tuple[str, ...] = ()

    @classmethod
    def of(cls, state_dict: Any) -> "MeshRecord | None":
        """The mesh of the first DTensor in a (nested) state dict, or ``None``."""
        from torch.distributed.tensor import DTensor

        stack = [state_dict] if isinstance(state_dict, dict) else []
        while stack:
            for value in stack.pop().values():
                if isinstance(value, DTensor):
                    mesh = value.device_mesh
                    return cls(tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()))
                if isinstance(value, dict):
                    stack.append(value)
        return None

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dims": list(self.dims)}


@dataclasses.dataclass(frozen=True)
class SavedConfig:
    """The writer settings recorded with a checkpoint."""

    mode: str | None = None
    compression: str | None = None
    max_block_size: int | None = None


@dataclasses.dataclass(frozen=True)
class ChainRecord:
    """An incremental checkpoint's place in its chain: the sibling it was saved against, how many
    incremental saves lie between it and a full one (``depth``), and of its items' stored bytes (its
    own, inline ones included, and referenced) those it references."""

    base: str
    depth: int
    referenced_bytes: int
    stored_bytes: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: Any, where: str) -> "ChainRecord":
        if not isinstance(doc, dict) or not is_sibling_name(doc.get("base")):
            raise CheckpointFormatError(f"{where}: 'chain' must be {{'base': a sibling's name, 'depth', ...}}")
        field = FieldReader(doc, f"{where}: chain")
        referenced, stored = field.count("referenced_bytes") or 0, field.count("stored_bytes") or 0
        if referenced > stored:
            raise CheckpointFormatError(f"{where}: 'chain' references more bytes than its items store")
        return cls(doc["base"], require_count(doc.get("depth"), f"{where}: chain depth"), referenced, stored)


@dataclasses.dataclass(frozen=True)
class Header:
    """Everything in ``ckptio.json`` besides the keys and item records: the schema's one owner."""

    files: dict[str, int]  # data file -> size in bytes
    format_version: int = FORMAT_VERSION
    written_by: str | None = None
    torch_version: str | None = None
    created_unix: float = 0.0
    save_id: str | None = None
    world_size: int | None = None
    mesh: MeshRecord | None = None
    config: SavedConfig = SavedConfig()
    writer_ranks: dict[str, int] = dataclasses.field(default_factory=dict)  # data file -> rank that wrote it
    dcp_version: str | None = None
    chain: ChainRecord | None = None  # an incremental save's
    features: tuple[str, ...] = ()  # what the document uses beyond the base format (``tables.FEATURES``)

    def to_json(self) -> dict[str, Any]:
        chain = {"chain": self.chain.to_json()} if self.chain is not None else {}
        chain |= {"features": list(self.features)} if self.features else {}
        return chain | {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "written_by": self.written_by,
            "torch_version": self.torch_version,
            "created_unix": self.created_unix,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "mesh": self.mesh.to_json() if self.mesh else None,
            "config": dataclasses.asdict(self.config),
            "files": dict(self.files),
            "writer_ranks": dict(self.writer_ranks),
            "dcp_version": self.dcp_version,
        }

    @classmethod
    def from_json(
        cls, doc: dict[str, Any], where: str, checked_files: tuple[dict[str, int], dict[str, int]],
        features: tuple[str, ...] = (),
    ) -> Header:  # fmt: skip
        """Validate the header fields of a decoded document; missing optional fields get defaults.
        ``checked_files``: the data files and their writers, and ``features``, already validated."""
        field = FieldReader(doc, where)
        files, writer_ranks = checked_files
        config = FieldReader(field.mapping("config"), f"{where}: config")
        mesh = field.mapping("mesh", nullable=True)
        chain = doc.get("chain")
        created = created_unix(field.value("created_unix", (int, float), 0.0), where)
        return cls(
            files=files,
            format_version=field.value("format_version", int, None),
            written_by=field.value("written_by", str, None),
            torch_version=field.value("torch_version", str, None),
            created_unix=created,
            save_id=field.value("save_id", str, None),
            world_size=field.count("world_size"),
            mesh=_mesh_from_json(mesh, where) if mesh is not None else None,
            config=SavedConfig(
                mode=config.value("mode", str, None),
                compression=config.value("compression", str, None),
                max_block_size=config.count("max_block_size"),
            ),
            writer_ranks=writer_ranks,
            dcp_version=field.value("dcp_version", str, None),
            chain=None if chain is None else ChainRecord.from_json(chain, where),
            features=features,
        )


def created_unix(value: Any, where: str) -> float:
    """A header's ``created_unix``: a plausible Unix time."""
    plausible = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not plausible or not 0 <= value < 1e11:
        raise CheckpointFormatError(f"{where}: 'created_unix' must be a plausible Unix time, got {value!r:.40}")
    return float(value)


def _mesh_from_json(mesh: dict[str, Any], where: str) -> MeshRecord:
    shape, dims = mesh.get("shape"), mesh.get("dims", [])
    if not isinstance(shape, list) or not isinstance(dims, list) or not all(isinstance(d, str) for d in dims):
        raise CheckpointFormatError(f"{where}: 'mesh' must be {{'shape': [ints], 'dims': [names]}}, got {mesh!r}")
    return MeshRecord(tuple(require_counts(shape, f"{where}: mesh")), tuple(dims))


class FieldReader:
    """Typed access to one JSON object's fields; a wrong type is a ``CheckpointFormatError`` naming the field."""

    def __init__(self, doc: dict[str, Any], where: str):
        self.doc, self.where = doc, where

    def value(self, name: str, kind: type | tuple[type, ...], default: Any) -> Any:
        value = self.doc.get(name)
        if value is None:
            return default
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise CheckpointFormatError(f"{self.where}: field {name!r} has the wrong type: {value!r}")
        return value

    def count(self, name: str) -> int | None:
        value = self.doc.get(name)
        return None if value is None else require_count(value, f"{self.where}: field {name!r}")

    def mapping(self, name: str, *, required: bool = False, nullable: bool = False) -> Any:
        if name not in self.doc and required:
            raise CheckpointFormatError(f"{self.where}: required field {name!r} is missing")
        value = self.doc.get(name, None if nullable else {})
        if value is None and nullable:
            return None
        if not isinstance(value, dict):
            raise CheckpointFormatError(f"{self.where}: field {name!r} must be a JSON object, got {value!r:.80}")
        return value


# ---------------------------------------------------------------------------------------
# The document


@dataclasses.dataclass
class Manifest:
    """A decoded, validated ckptio metadata document."""

    header: Header
    metadata: Metadata
    items: Mapping[MetadataIndex, StoredItem]  # built on first use (view.ItemTable)
    per_rank: dict[str, dict[int, StoredItem]] = dataclasses.field(default_factory=dict)  # kept per-rank objects
    #: items stored in pieces (incremental saves): the virtual file name their records give -> its runs
    extents: dict[str, tuple[Extent, ...]] = dataclasses.field(default_factory=dict)

    @property
    def files(self) -> dict[str, int]:
        return dict(self.header.files)

    def runs_of(self, item: StoredItem) -> tuple[Extent, ...]:
        """Where ``item``'s stored bytes lie: its file from its offset, or the runs of an item stored in pieces."""
        return self.extents.get(item.file) or (Extent(item.file, item.offset, item.stored_bytes),)

    def records(self) -> list[StoredItem]:
        """Every stored record: the items' and each rank's kept copies of per-rank objects."""
        return [*self.items.values(), *(copy for copies in self.per_rank.values() for copy in copies.values())]


def placed_blocks(
    records: Iterable[StoredItem], file: str, extents: Mapping[str, tuple[Extent, ...]] | None = None
) -> list[tuple[int, int, int]]:
    """``(file offset, stored length, CRC32C)`` of every block ``records`` place in ``file``, by offset; an
    item stored in pieces places its blocks along its runs (``extents``: a manifest's, by virtual name)."""
    placed = []
    for record in records:
        runs = (extents or {}).get(record.file) or (record.extents if isinstance(record, Reference) else ())
        if len(runs) <= 1:
            if record.file == file:
                placed.extend(
                    (offset, *block) for offset, block in zip(record.block_offsets[:-1], record.blocks, strict=True)
                )
            continue
        if all(run.file != file for run in runs):
            continue
        run, at = 0, 0  # the run holding the next block, and the block's offset in it
        for length, crc in record.blocks:
            while at >= runs[run].length:
                run, at = run + 1, 0
            if runs[run].file == file:
                placed.append((runs[run].offset + at, length, crc))
            at += length
    return sorted(placed)


def planner_data_json(planner_data: Any) -> Any:
    """torch's default planner stores ``{fqn: (path, elements...)}``; keep it as JSON lists."""
    if planner_data is None:
        return None
    if not isinstance(planner_data, dict) or not all(
        isinstance(k, str) and isinstance(v, (tuple, list)) and all(isinstance(p, (str, int)) for p in v)
        for k, v in planner_data.items()
    ):
        raise CheckpointFormatError(
            "the save planner's planner_data is not {str: tuple of str/int}; ckptio stores metadata as "
            "JSON and cannot keep arbitrary objects there. Use torch's DefaultSavePlanner or a planner "
            "whose planner_data is a flat-key mapping."
        )
    return {k: list(v) for k, v in planner_data.items()}


def manifest_of(
    header: Header,
    state: dict[str, Any],
    items: Any,
    per_rank: dict[str, Any],
    planner_data: Any,
    extents: dict[str, tuple[Extent, ...]] | None = None,
) -> Manifest:
    """The manifest of a decoded document (``planner_data`` already checked by ``rules``)."""
    metadata = Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data=items)
    if header.dcp_version is not None:
        metadata.version = header.dcp_version
    return Manifest(header=header, metadata=metadata, items=items, per_rank=per_rank, extents=extents or {})
