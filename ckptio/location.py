"""What Writer and Reader share: a checkpoint location and the store opened for it lazily."""

from __future__ import annotations

import os
from typing import Any

from .errors import CheckpointError
from .storage import FsspecStore, open_store


class CheckpointLocation:
    _role: tuple[str, str]  # ("Writer", "dcp.save") or ("Reader", "dcp.load"), for the error below
    checkpoint_id: str | None
    storage_options: dict[str, Any]
    config: Any
    _store: FsspecStore | None

    def _open_store(self) -> FsspecStore:
        if self._store is None:
            if self.checkpoint_id is None:
                kind, call = self._role
                raise CheckpointError(
                    f"ckptio.{kind} has no checkpoint location: pass it to {kind}(...) or to {call}(checkpoint_id=...)"
                )
            self._store = open_store(self.checkpoint_id, self.storage_options, self.config)
        return self._store

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
