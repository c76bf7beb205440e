"""Every failure ckptio raises is a ``CheckpointError``.

torch's own ``CheckpointException`` derives from ``BaseException``, so ``except Exception``
does not catch it; ``ckptio.save`` / ``ckptio.load`` unwrap it into these classes.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error ckptio raises."""


class CheckpointNotFoundError(CheckpointError):
    """Nothing (or no checkpoint) exists at the given location."""


class CheckpointExistsError(CheckpointError):
    """A committed checkpoint already exists where a save was asked to write."""


class IncompleteCheckpointError(CheckpointError):
    """Data files exist but the save never committed its metadata."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes do not match the checksum or size recorded at save time."""


class CheckpointFormatError(CheckpointError):
    """The metadata is not a valid ckptio document (garbage, future version, unsafe names)."""


class NotCkptioCheckpointError(CheckpointFormatError):
    """The location holds a checkpoint written by another tool (e.g. torch DCP)."""


class StorageError(CheckpointError):
    """The storage backend failed (after retries) for a named object."""


class PerRankStateError(CheckpointError):
    """Per-rank state would be lost or silently collapsed."""


class UnsafeObjectError(CheckpointError):
    """A saved object needs a type the safe loader does not allow."""
