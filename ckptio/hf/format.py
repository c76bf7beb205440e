"""The Hugging Face safetensors format: dtype names, the file header and the shard index. Pure.

A file is an 8-byte little-endian header length N, N bytes of JSON (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}``), then the tensors' raw little-endian
row-major bytes, offsets counted from the end of the header. Everything here treats a file and an
index as untrusted input: each check runs before anything is allocated from the numbers it reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import torch

from ckptio.config import INT64_LIMIT
from ckptio.errors import CheckpointFormatError
from ckptio.format.rules import check_shape

#: safetensors' own bound on the JSON header (its reader refuses larger ones).
MAX_HEADER_BYTES = 100_000_000
#: Bytes read from the start of a file in the first request: the length and, almost always, the header.
HEADER_PROBE_BYTES = 64 << 10
MAX_DIMS = 64
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "C64": torch.complex64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class FileTensor:
    """One tensor of a safetensors file: its name there, and where its bytes lie in ``file``."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def header_length(prefix: bytes, file: str, file_size: int) -> int:
    """The JSON header's length from a file's first 8 bytes, checked against the file's size."""
    if file_size < 8 or len(prefix) < 8:
        raise CheckpointFormatError(f"{file}: {file_size} bytes is too short for a safetensors file (no header)")
    length = int.from_bytes(prefix[:8], "little")
    if length > MAX_HEADER_BYTES:
        raise CheckpointFormatError(
            f"{file}: the header claims {length} bytes, more than safetensors' limit of {MAX_HEADER_BYTES}; "
            "this is not a valid safetensors file"
        )
    if 8 + length > file_size:
        raise CheckpointFormatError(
            f"{file}: the header claims {length} bytes but the file holds only {file_size - 8} after the length "
            "(truncated?)"
        )
    return length


def parse_header(raw: bytes, file: str, file_size: int, where: str | None = None) -> list[FileTensor]:
    """The tensors a file's JSON header (``raw``, without the 8-byte length) describes, each one
    checked: a known dtype, a shape of non-negative integers, a byte range of exactly
    ``numel * itemsize`` bytes inside the file, and no two ranges overlapping. ``where`` names
    the file in errors (default: ``file``)."""
    shown = where or file
    doc = _json_object(raw, shown)
    data_start = 8 + len(raw)
    data_bytes = file_size - data_start
    tensors = []
    for name, entry in doc.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise CheckpointFormatError(f"{shown}: '__metadata__' must map strings to strings")
            continue
        at = f"tensor {name!r} in {shown}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointFormatError(f"{at}: expected exactly 'dtype', 'shape' and 'data_offsets'")
        dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise CheckpointFormatError(
                f"{at}: dtype {entry['dtype']!r} is not one ckptio can load (known: {', '.join(DTYPES)})"
            )
        shape = entry["shape"]
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(n) for n in shape):
            raise CheckpointFormatError(f"{at}: shape {shape!r:.200} is not a list of non-negative integers below 2^63")
        check_shape(shape, dtype.itemsize, at)
        offsets = entry["data_offsets"]
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(n) for n in offsets):
            raise CheckpointFormatError(f"{at}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if end < begin or end - begin != nbytes:
            raise CheckpointFormatError(
                f"{at}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but {entry['dtype']} {shape} "
                f"needs {nbytes}"
            )
        if end > data_bytes:
            raise CheckpointFormatError(
                f"{at}: bytes {begin}..{end} of the data lie past the end of the file, which holds {data_bytes} "
                "bytes of data (truncated?)"
            )
        tensors.append(FileTensor(name, file, dtype, tuple(shape), data_start + begin, nbytes))
    by_start = sorted((t for t in tensors if t.nbytes), key=lambda t: t.start)
    for before, after in zip(by_start, by_start[1:], strict=False):
        if after.start < before.start + before.nbytes:
            raise CheckpointFormatError(f"{shown}: the bytes of tensors {before.name!r} and {after.name!r} overlap")
    return tensors


def parse_index(raw: bytes, where: str) -> dict[str, str]:
    """``{tensor name: shard file}`` from a ``*.safetensors.index.json``; file names must be plain
    names in the same folder (an index must not send a reader elsewhere)."""
    doc = _json_object(raw, where)
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointFormatError(f"{where}: 'weight_map' must be a non-empty object of tensor name -> file")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not is_plain_file_name(file):
            raise CheckpointFormatError(
                f"{where}: tensor {name!r} is mapped to {file!r}, which is not a file name in this folder"
            )
    return weight_map


def is_plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < INT64_LIMIT


def _json_object(raw: bytes, where: str) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise CheckpointFormatError(f"{where}: the key {key!r} appears twice")
            out[key] = value
        return out

    try:
        doc = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointFormatError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{where}: expected a JSON object, found {type(doc).__name__}")
    return doc
