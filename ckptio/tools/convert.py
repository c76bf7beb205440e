"""Single-process conversions, any saved layout: a ckptio checkpoint into one ``torch.save`` file,
and a torch DCP checkpoint into a ckptio one."""

from __future__ import annotations

import os
from typing import Any

import fsspec
import torch

from ckptio.api import raising_checkpoint_errors, save
from ckptio.config import WriterConfig
from ckptio.loading.reader import Reader, check_file_sizes
from ckptio.loading.safe_load import SafeObjectsMixin
from ckptio.torch_seam import _EmptyStateDictLoadPlanner, _load_state_dict


class _SafeFullLoadPlanner(SafeObjectsMixin, _EmptyStateDictLoadPlanner):
    """Builds the whole state from the metadata (torch's planner for conversions), objects loaded safely."""


def load_full(checkpoint_id: str | os.PathLike, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole checkpoint as plain CPU tensors and objects, nested as it was saved."""
    state: dict[str, Any] = {}
    reader = Reader(checkpoint_id, storage_options=storage_options)
    manifest = reader.prefetch_metadata()
    # Every tensor is allocated before anything is read: first check that the files hold what the
    # metadata claims, so a crafted size cannot make this allocate far beyond the checkpoint.
    check_file_sizes(reader._open_store(), manifest)
    with raising_checkpoint_errors(f"load from {os.fspath(checkpoint_id)}"):
        # dcp.load copies the dict it is given; the private loader fills ours, as torch's dcp_to_torch_save does.
        _load_state_dict(state, storage_reader=reader, planner=_SafeFullLoadPlanner(), no_dist=True)
    return state


def to_torch_save(
    checkpoint_id: str | os.PathLike, output: str | os.PathLike, *, storage_options: dict[str, Any] | None = None
) -> int:
    """Write the checkpoint as a single ``torch.save`` file (a path or fsspec URL, written with
    ``storage_options`` too); return the number of top-level keys."""
    state = load_full(checkpoint_id, storage_options=storage_options)
    with fsspec.open(os.fspath(output), "wb", **(storage_options or {})) as f:
        torch.save(state, f)
    return len(state)


def from_torch_dcp(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    config: WriterConfig | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """Rewrite a checkpoint saved by torch DCP's own writers as a ckptio checkpoint, in one process
    holding the whole state; return the number of top-level keys. The source's objects are
    unpickled by torch's reader, so convert only checkpoints you trust."""
    source = os.fspath(source)
    state: dict[str, Any] = {}
    with raising_checkpoint_errors(f"load from {source}"):
        reader = torch_dcp_reader(source, storage_options)
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    save(state, destination, config, storage_options=storage_options)
    return len(state)


def torch_dcp_reader(url: str, storage_options: dict[str, Any] | None = None):
    """torch's own reader for a checkpoint its writers saved: FileSystemReader for local paths,
    FsspecReader (with ``storage_options``) for any other URL."""
    from torch.distributed.checkpoint import FileSystemReader

    from ckptio.storage import LocalStore, open_store
    from ckptio.torch_seam import FsspecReader

    if isinstance(open_store(url, storage_options), LocalStore):
        return FileSystemReader(url)
    return FsspecReader(url, **(storage_options or {}))
