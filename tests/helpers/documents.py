"""Small checkpoints and their ``ckptio.json`` for tests that damage or craft metadata."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptio
from ckptio.format.names import METADATA_NAME
from tests.helpers.metadata_view import readable_metadata

STATE = {"w": torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024), "b": torch.ones(8), "meta": {"x": 1}}


def fresh() -> dict:
    """A state of ``STATE``'s layout with other values, to load into."""
    return {"w": torch.zeros(64, 1024), "b": torch.zeros(8), "meta": {"x": None}}


def saved(tmp_path, name: str = "ck", state: dict = STATE, **config) -> str:
    """``state`` saved with ``ckptio.save`` (no inline items, so every item is in a data file)."""
    url = str(tmp_path / name)
    ckptio.save(state, url, ckptio.WriterConfig(tuning=ckptio.Tuning(inline_limit=0), **config))
    return url


def saved_with_dcp(tmp_path, name: str = "ckpt") -> str:
    """A tensor, a bytes object and a nested dict saved with plain ``dcp.save``."""
    url = str(tmp_path / name)
    state = {"w": torch.arange(70000.0), "blob": b"x" * 100, "cfg": {"lr": 0.1}}
    dcp.save(state, storage_writer=ckptio.Writer(url))
    return url


def meta_path(url: str) -> str:
    return os.path.join(url, METADATA_NAME)


def read_doc(url: str) -> dict:
    """The checkpoint's metadata in version 2's readable schema (a JSON object per item)."""
    return readable_metadata(url)


def read_stored_doc(url: str) -> dict:
    """The checkpoint's metadata as stored (version 3)."""
    with open(meta_path(url), "rb") as f:
        return json.load(f)


def write_doc(url: str, doc: dict) -> None:
    with open(meta_path(url), "w") as f:
        json.dump(doc, f)


def load_error(url: str, state: dict) -> ckptio.CheckpointError:
    """The ckptio error a plain ``dcp.load`` of ``url`` raises (the test fails if it loads)."""
    with pytest.raises(CheckpointException) as info:
        dcp.load(state, storage_reader=ckptio.Reader(url))
    return ckptio.unwrap(info.value)


#: Numbers at and past int64's end, for header fields.
HUGE = [2**63, 2**64, 2**63 - 1]


def rewrite_in_version(url: str, version: int) -> dict:
    """The checkpoint's metadata written again in ckptio 0.x's format ``version`` (3 or 4), and that document."""
    from ckptio.legacy.reader import encode_legacy

    reader = ckptio.Reader(url)
    reader.read_metadata()
    manifest = reader.manifest
    items = {(index.fqn, index.offset): item for index, item in manifest.items.items()}
    raw = encode_legacy(manifest.metadata, items, manifest.header, manifest.per_rank, format_version=version)
    with open(meta_path(url), "wb") as f:
        f.write(raw)
    return json.loads(raw)
