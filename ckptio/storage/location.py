"""What Writer and Reader share: a checkpoint location and the store opened for it lazily."""

from __future__ import annotations

import os
from typing import Any

import fsspec
from fsspec.core import split_protocol

from ckptio.config import StorageConfig
from ckptio.errors import CheckpointError
from ckptio.storage import FsspecStore, open_store


class CheckpointLocation:
    _role: tuple[str, str]  # ("Writer", "dcp.save") or ("Reader", "dcp.load"), for the error below
    checkpoint_id: str | None
    storage_options: dict[str, Any]
    storage_config: StorageConfig
    _store: FsspecStore | None

    def _open_store(self) -> FsspecStore:
        if self._store is None:
            if self.checkpoint_id is None:
                kind, call = self._role
                raise CheckpointError(
                    f"ckptio.{kind} has no checkpoint location: pass it to {kind}(...) or to {call}(checkpoint_id=...)"
                )
            self._store = open_store(self.checkpoint_id, self.storage_options, self.storage_config)
        return self._store

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """A local path, or a URL whose protocol an fsspec filesystem serves (so DCP's storage
        auto-detection does not pick ckptio for locations it cannot open)."""
        if isinstance(checkpoint_id, os.PathLike):
            return True
        if not isinstance(checkpoint_id, str) or not checkpoint_id:
            return False
        protocol, _ = split_protocol(checkpoint_id)
        if protocol is None:
            return True
        try:
            fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError):
            return False
        return True
