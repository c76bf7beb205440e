"""The safetensors header parser (``ckptio.hf.format``): numbers past int64 or past the file are refused
naming file and tensor."""

from __future__ import annotations

import json
from typing import Any

import pytest

import ckptio
from tests.helpers.documents import HUGE


def _write_safetensors(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize("field", ["shape beside 0", "shape alone", "begin", "end"])
def test_safetensors_header_numbers_past_int64_or_the_file_are_refused_naming_file_and_tensor(field, value, tmp_path):
    entry: dict[str, Any] = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    if field == "shape beside 0":
        entry["shape"] = [value, 0]
        entry["data_offsets"] = [0, 0]
    elif field == "shape alone":
        entry["shape"] = [value]
    elif field == "begin":
        entry["data_offsets"] = [value, value + 8]
    else:
        entry["data_offsets"] = [0, value]
    _write_safetensors(tmp_path / "model.safetensors", {"w": entry}, bytes(8))
    with pytest.raises(ckptio.CheckpointFormatError, match=r"tensor 'w' in .*model\.safetensors"):
        ckptio.HFReader(tmp_path).prefetch_metadata()
