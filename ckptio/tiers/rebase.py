"""A tiered incremental save made against a base whose drain had not finished (``incremental.note_queued``),
made full instead if that base never reaches the durable tier.

Each rank of such a save keeps its items that reference the base whole in its node's *full copy*
(``writing.full_copy_name``), those first, and reports where they lie (``FullCopy``,
``ObjectReport.full_copy``); the coordinator encodes, beside the save's document, the document of the same
save with those records in place of the references (``Writer._finish``). The drain is ordered, so when the
save's commit runs every rank has uploaded what it could of the base. If a referenced file is missing then
(the base's drain failed or was refused), the commit does not publish a document that references nothing:
it lists the full document's files on the durable tier (``REBASE_NAME``), every rank's drain uploads its
full copy's first bytes when it finds its own listed (``asked_to_upload``), and the commit publishes the
full document once they are there (``Rebase``).
A base that did arrive is referenced as usual: the full copies are never uploaded.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch.distributed.checkpoint.metadata import MetadataIndex

from ckptio.format.names import REBASE_NAME
from ckptio.format.records import StoredItem
from ckptio.storage import FsspecStore


@dataclasses.dataclass(frozen=True)
class FullCopy:
    """Where a rank's items that reference a base still draining lie whole in its full copy ``file``: its
    first ``nbytes``, recorded by ``records``."""

    file: str
    nbytes: int
    records: dict[MetadataIndex, StoredItem]


def asked_to_upload(store: FsspecStore, name: str) -> bool:
    """Whether the commit at ``store`` asks for the full copy ``name`` (``REBASE_NAME`` lists them: every rank
    of the save knows its own full copy's name, which no other save has)."""
    try:
        return name in store.read(REBASE_NAME).decode(errors="replace").split("\n")
    except FileNotFoundError:
        return False


@dataclasses.dataclass
class Rebase:
    """The save's full document (``document``, naming ``files`` written by ``writers``), and the coordinator's
    own full-copy upload (``upload``, ``None`` where it kept none)."""

    document: bytes
    files: dict[str, int]
    writers: dict[str, int]
    upload: Any = None  # drain.Upload

    def run(self, store: FsspecStore, deadline: float, arrived: Callable[..., None]) -> None:
        """Ask every rank for its full copy, upload this rank's, and return once every file of the full
        document is there (``arrived(files, writers)`` waits for them)."""
        store.put_atomic(REBASE_NAME, "\n".join(sorted(self.files)).encode())
        if self.upload is not None:
            self.upload.run(deadline)
        arrived(self.files, self.writers)
