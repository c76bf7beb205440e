"""The commit policy: a checkpoint becomes loadable when its ``ckptio.json`` is published, and
a committed checkpoint is replaced only when the save asked to overwrite it, in which case the
old data files are deleted only after the new metadata has replaced the old."""

from __future__ import annotations

import logging

from ckptio.errors import CheckpointExistsError, CheckpointFormatError, CheckpointNotFoundError, StorageError
from ckptio.format.names import METADATA_NAME
from ckptio.format.versions import decode_metadata
from ckptio.storage import FsspecStore

log = logging.getLogger(__name__)


def check_target(store: FsspecStore, overwrite: bool) -> list[str]:
    """Refuse to replace a committed checkpoint unless ``overwrite``; return the data files an
    overwrite supersedes (to delete once the new checkpoint has committed)."""
    try:
        old = store.read(METADATA_NAME)
    except FileNotFoundError:
        return []
    except CheckpointNotFoundError as exc:  # e.g. no such bucket: nowhere to save to
        raise StorageError(f"cannot save to {store.url}: {exc}") from None
    if not overwrite:
        raise CheckpointExistsError(
            f"{store.describe(METADATA_NAME)} already holds a committed checkpoint; save to a new path, "
            "or pass overwrite=True (ckptio.Writer(path, overwrite=True) or WriterConfig(overwrite=True)) to "
            "replace it (the old one stays loadable until the new one commits)"
        )
    try:
        return sorted(decode_metadata(old, store.describe(METADATA_NAME)).files)
    except CheckpointFormatError as exc:
        log.warning("ckptio: overwriting an unreadable checkpoint; its data files are left in place: %s", exc)
        return []


def publish(store: FsspecStore, document: bytes, files: dict[str, int], superseded: list[str], overwrite: bool) -> None:
    """Commit: publish the metadata, then delete the superseded data files it no longer names.

    Without ``overwrite`` the metadata is created only if absent, atomically where the backend
    allows it (POSIX: a hard link; S3: a conditional PUT), so of two jobs saving to one path at
    once exactly one commits; the other's data files are deleted and it raises."""
    store.prepare_directory()  # no rank may have written a data file (everything inline)
    if overwrite:
        store.put_atomic(METADATA_NAME, document)
    else:
        try:
            store.put_if_absent(METADATA_NAME, document)
        except FileExistsError:
            store.delete_best_effort(sorted(files))
            raise CheckpointExistsError(
                f"another save committed {store.describe(METADATA_NAME)} while this one was writing; this save's "
                "data files were removed and the other checkpoint is intact. Save each job to its own path"
            ) from None
    stale = [name for name in superseded if name not in files]
    if stale:
        store.delete_best_effort(stale)
