"""``HFReader``: Hugging Face safetensors weights, from any fsspec URL, into any sharded state.

Example::

    reader = ckptio.HFReader("s3://models/Llama-3.1-8B", key_map="model.")
    ckptio.load({"model": model_sd, "optimizer": optim_sd}, reader)   # fills model.*, leaves the rest
    dcp.load(hf_named_state, storage_reader=ckptio.HFReader("/models/Llama-3.1-8B"))
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ckptio.config import MiB, StorageConfig, nested_config
from ckptio.errors import CheckpointError, CheckpointFormatError, CheckpointNotFoundError, remember_metadata_error
from ckptio.format.names import METADATA_NAME, Codec, ItemKind, dtype_name
from ckptio.format.records import StoredItem
from ckptio.hf.format import (
    HEADER_PROBE_BYTES,
    INDEX_NAME,
    SINGLE_FILE_NAME,
    FileTensor,
    header_length,
    is_plain_file_name,
    parse_header,
    parse_index,
)
from ckptio.loading.box_reads import load_boxes
from ckptio.loading.read_once import DIRECT, load_group, read_once
from ckptio.loading.reader import Reader
from ckptio.loading.sources import ByteSource, Prepared
from ckptio.state.keys import CanonicalKeyDict
from ckptio.storage import FsspecStore, RangeRequest
from ckptio.torch_seam import flatten_state_dict

log = logging.getLogger(__name__)

#: Shared reads (HSDP replicas) plan a safetensors tensor in units of this many bytes: the rank that
#: reads a unit sends it whole to every rank that needs any of it.
SHARED_UNIT_BYTES = 4 * MiB

KeyMap = str | Callable[[str], "str | None"] | None


class HFReader(Reader):
    """A DCP ``StorageReader`` for Hugging Face safetensors weights on any fsspec URL: a folder
    (``model.safetensors.index.json`` and its shards, or ``model.safetensors``, or its only
    ``*.safetensors`` files), or one ``.safetensors`` file or index named directly.

    Each rank reads only the bytes of its own slices (FSDP, TP, HSDP, any mesh DCP plans), with
    ckptio's retries and request planning; HSDP replicas share reads as with ``Reader``
    (``dedup_reads``). Headers and the index are checked as untrusted input before anything is
    allocated from them.

    ``key_map``: how a file's tensor names become state keys: ``None`` (as they are), a prefix
    (``"model."``: ``layers.0.w`` -> ``model.layers.0.w``), or a function from tensor name to
    state key (``None`` leaves that tensor out). ``storage_config``, ``dedup_reads``: as ``Reader``'s.

    dtypes convert on load as ``Reader``'s do (``conversion.py``: exact widenings, such as a bf16
    file into fp32 parameters), except that rounding (fp32 weights into bf16 parameters, to nearest
    even) is allowed unless ``allow_rounding=False``: that is what loading weights into a model of
    lower precision means. Truncation and wrap-around (floats into integers, narrower integers) are
    always refused.
    Through ``ckptio.load`` the state may hold keys the file lacks (optimizer state, step): they
    are left as they are and logged. Through plain ``dcp.load`` every state key must be in the
    file, as torch's planner requires, unless it is given ``DefaultLoadPlanner(allow_partial_load=True)``.
    """

    _role = ("HFReader", "dcp.load")

    def __init__(
        self,
        checkpoint_id: str | os.PathLike | None = None,
        *,
        key_map: KeyMap = None,
        storage_options: dict[str, Any] | None = None,
        storage_config: StorageConfig | None = None,
        dedup_reads: bool | str = "auto",
        read_gap_bytes: int | None = None,
        allow_rounding: bool = True,
    ):
        if not (key_map is None or isinstance(key_map, str) or callable(key_map)):
            raise TypeError(f"key_map must be a prefix string, a function or None, got {type(key_map).__name__}")
        if read_gap_bytes is not None:
            warnings.warn(
                "HFReader(read_gap_bytes=...) is now HFReader(storage_config=ckptio.StorageConfig(read_gap_bytes="
                "...)), as on Reader; the old name goes in ckptio 1.1",
                DeprecationWarning,
                stacklevel=2,
            )
            storage_config = dataclasses.replace(
                nested_config(StorageConfig, storage_config, "storage_config"), read_gap_bytes=read_gap_bytes
            )
        self.key_map = key_map
        self._entry: str | None = None
        super().__init__(
            checkpoint_id,
            storage_options=storage_options,
            verify=False,  # safetensors files carry no checksums; headers and sizes are still checked
            storage_config=storage_config,
            dedup_reads=dedup_reads,
            allow_rounding=allow_rounding,
        )

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            checkpoint_id = os.fspath(checkpoint_id).rstrip("/")
            folder, _, last = checkpoint_id.rpartition("/")
            self._entry = None
            if last.endswith((".safetensors", ".json")):  # one file (or index) named directly
                checkpoint_id, self._entry = folder or ".", last
        super().reset(checkpoint_id)
        self._tensors: dict[MetadataIndex, FileTensor] = {}

    # --- DCP protocol ------------------------------------------------------------------
    def read_metadata(self, *args: Any) -> Metadata:
        prefetched, self._prefetched = self._prefetched, None
        try:
            catalog = prefetched if prefetched is not None else self._read_catalog(load_group())
            metadata = self._metadata_for(catalog)
        except CheckpointError as exc:
            remember_metadata_error(exc)
            raise
        return metadata

    def prefetch_metadata(self, process_group: Any = DIRECT) -> list[FileTensor]:
        """Read and check the index and headers now, raising directly; the next
        ``read_metadata`` uses them instead of reading again. Given a ``process_group``
        (``None``: the default group), one of its ranks reads and the others receive them."""
        self._prefetched = self._read_catalog(process_group)
        return self._prefetched

    def _read_catalog(self, group: Any) -> list[FileTensor]:
        store = self._open_store()
        return read_once(lambda: read_catalog(store, self._entry), group, f"{store.url} {self._entry}")

    def state_keys(self, catalog: list[FileTensor]) -> dict[str, FileTensor]:
        """The state key each tensor of ``catalog`` loads into (``key_map`` applied)."""
        by_key: dict[str, FileTensor] = {}
        for tensor in catalog:
            key = self._state_key(tensor.name)
            if key is None:
                continue
            if key in by_key:
                raise CheckpointFormatError(
                    f"tensors {by_key[key].name!r} and {tensor.name!r} both map to the state key {key!r} "
                    f"(key_map={self.key_map!r}); make the mapping one to one"
                )
            by_key[key] = tensor
        return by_key

    def _metadata_for(self, catalog: list[FileTensor]) -> Metadata:
        by_key = self.state_keys(catalog)
        state_md: dict[str, TensorStorageMetadata] = CanonicalKeyDict()
        records: dict[MetadataIndex, StoredItem] = {}
        self._tensors = {}
        for key, tensor in by_key.items():
            zeros = torch.Size([0] * len(tensor.shape))
            state_md[key] = TensorStorageMetadata(
                TensorProperties(dtype=tensor.dtype),
                torch.Size(tensor.shape),
                [ChunkStorageMetadata(offsets=zeros, sizes=torch.Size(tensor.shape))],
            )
            index = MetadataIndex(key, zeros)
            self._tensors[index] = tensor
            records[index] = _shared_read_record(tensor)
        storage_meta = StorageMeta(checkpoint_id=self.checkpoint_id, load_id=uuid.uuid4().hex[:16])
        return Metadata(state_dict_metadata=state_md, storage_data=records, storage_meta=storage_meta)

    def _state_key(self, name: str) -> str | None:
        if self.key_map is None:
            return name
        if isinstance(self.key_map, str):
            return self.key_map + name
        key = self.key_map(name)
        if key is not None and not isinstance(key, str):
            raise TypeError(f"key_map returned {key!r} for {name!r}; it must return a state key (str) or None")
        return key

    # --- the item source (``sources.ItemSource``): tensors read as boxes of the files ------------
    def item_for(self, read_item: ReadItem) -> FileTensor:
        try:
            return self._tensors[self._stored_key(read_item)]
        except KeyError:
            raise CheckpointError(
                f"key {read_item.storage_index.fqn!r} is not a tensor of {self.checkpoint_id}"
            ) from None

    def prepare(self, pairs: list[tuple[ReadItem, Any]], planner: LoadPlanner, *, places: bool) -> Prepared:
        return Prepared(pairs)  # box reads resolve destinations as they go: shared bytes go to buffers

    def deliver(self, source: ByteSource, prepared: Prepared, planner: LoadPlanner) -> None:
        load_boxes(source, prepared.batch, planner, source.read_gap_bytes, self.allow_rounding)


def _shared_read_record(tensor: FileTensor) -> StoredItem:
    """The tensor as a raw item of ``SHARED_UNIT_BYTES`` blocks (no checksums): what shared-read
    planning works on."""
    count = math.ceil(tensor.nbytes / SHARED_UNIT_BYTES)
    blocks = tuple((min(SHARED_UNIT_BYTES, tensor.nbytes - b * SHARED_UNIT_BYTES), 0) for b in range(count))
    return StoredItem(
        file=tensor.file,
        offset=tensor.start,
        logical_bytes=tensor.nbytes,
        kind=ItemKind.TENSOR,
        dtype=dtype_name(tensor.dtype),
        shape=tensor.shape,
        codec=Codec.RAW,
        block_size=SHARED_UNIT_BYTES,
        blocks=blocks,
    )


def report_hf_matches(state: dict[str, Any], offered: dict[str, FileTensor], where: str | None) -> None:
    """Before a partial load: fail when no key of the state is among the file's (the key map is
    wrong, and nothing would load), else log the state keys that stay as they are."""
    flat, _ = flatten_state_dict(state)
    known = CanonicalKeyDict(offered)
    loaded = [key for key in flat if key in known]
    if flat and not loaded:
        raise CheckpointError(
            f"none of the {len(flat)} keys of the state is a tensor of {where} (state keys: "
            f"{_examples(flat)}; the file's tensors load as: {_examples(offered)}). Pass key_map= to HFReader "
            "(a prefix, or a function from tensor name to state key)"
        )
    untouched = [key for key in flat if key not in known]
    if untouched:
        log.info(
            "ckptio: %d state keys are loaded from %s; %d it does not hold stay as they are (%s)",
            len(loaded),
            where,
            len(untouched),
            _examples(untouched),
        )


def _examples(keys: Any, count: int = 3) -> str:
    keys = list(keys)
    return ", ".join(repr(k) for k in keys[:count]) + (f" and {len(keys) - count} more" if len(keys) > count else "")


# --- finding and checking the files ----------------------------------------------------------
def read_catalog(store: FsspecStore, entry: str | None = None) -> list[FileTensor]:
    """Every tensor of the safetensors weights at ``store`` (or of ``entry``, a file or index
    in it), from the index and the files' headers, all checked."""
    files, weight_map = _find_files(store, entry)
    workers = max(1, min(len(files), store.config.max_concurrency))
    with ThreadPoolExecutor(workers) as pool:
        headers = dict(zip(files, pool.map(lambda f: _read_header(store, f), files), strict=True))
    if weight_map is None:
        seen: dict[str, str] = {}
        for file, tensors in headers.items():
            for t in tensors:
                if t.name in seen:
                    raise CheckpointFormatError(
                        f"tensor {t.name!r} is in both {store.describe(seen[t.name])} and {store.describe(file)}, "
                        "and no index says which to load"
                    )
                seen[t.name] = file
        return [t for tensors in headers.values() for t in tensors]
    by_file = {file: {t.name: t for t in tensors} for file, tensors in headers.items()}
    catalog = []
    for name, file in weight_map.items():
        tensor = by_file[file].get(name)
        if tensor is None:
            raise CheckpointFormatError(
                f"the index maps tensor {name!r} to {store.describe(file)}, whose header does not list it"
            )
        catalog.append(tensor)
    return catalog


def _find_files(store: FsspecStore, entry: str | None) -> tuple[list[str], dict[str, str] | None]:
    """The shard files to read, and the index's weight map when there is one."""
    if entry is not None:
        if not entry.endswith(".json"):
            return [entry], None
        try:
            return _from_index(store, entry)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{store.describe(entry)} does not exist") from None
    try:
        return _from_index(store, INDEX_NAME)
    except FileNotFoundError:
        pass
    names = store.list_names()
    if names is None:
        raise CheckpointNotFoundError(f"no safetensors weights at {store.url}: the path does not exist")
    if SINGLE_FILE_NAME in names:
        return [SINGLE_FILE_NAME], None
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    if len(indexes) == 1:
        return _from_index(store, indexes[0])
    files = [n for n in names if n.endswith(".safetensors")]
    if not files:
        hint = "; it holds a ckptio checkpoint: load it with ckptio.Reader" if METADATA_NAME in names else ""
        shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "") if names else "nothing"
        raise CheckpointNotFoundError(f"no safetensors files at {store.url} (it holds {shown}){hint}")
    return files, None


def _from_index(store: FsspecStore, name: str) -> tuple[list[str], dict[str, str]]:
    """Raises ``FileNotFoundError`` when there is no such index."""
    weight_map = parse_index(store.read(name), store.describe(name))
    return sorted(set(weight_map.values())), weight_map


def _read_header(store: FsspecStore, file: str) -> list[FileTensor]:
    where = store.describe(file)
    if not is_plain_file_name(file):
        raise CheckpointFormatError(f"{where}: not a file name in this folder")
    try:
        size = store.size(file)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where} does not exist (named by the index or the URL)") from None
    (probe,) = store.read_ranges([RangeRequest(file, 0, min(size, HEADER_PROBE_BYTES))])
    length = header_length(probe, where, size)
    if 8 + length > len(probe):
        (rest,) = store.read_ranges([RangeRequest(file, len(probe), 8 + length)])
        probe = bytes(probe) + bytes(rest)
    if len(probe) < 8 + length:
        raise CheckpointFormatError(f"{where}: the header is cut short (the file changed while it was read?)")
    return parse_header(memoryview(probe)[8 : 8 + length], file, size, where)
