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

    #: the data file whose bytes failed, where one is known (a tiered load then reads it elsewhere)
    file: str | None = None


def damaged_file(message: str, file: str | None) -> CorruptCheckpointError:
    """A ``CorruptCheckpointError`` that names the data file (``.file``) it is about."""
    exc = CorruptCheckpointError(message)
    exc.file = file
    return exc


class CheckpointFormatError(CheckpointError):
    """The metadata is not a valid ckptio document (garbage, future version, unsafe names)."""


class NotCkptioCheckpointError(CheckpointFormatError):
    """The location holds a checkpoint written by another tool (e.g. torch DCP)."""


class LossyConversionError(CheckpointFormatError):
    """Loading would convert a stored dtype into the state's with values changed (narrowing,
    truncation, rounding not opted into). A ``CheckpointFormatError``, as ``HFReader`` raised before."""


class MixedFragmentsError(CheckpointFormatError):
    """The metadata fragments of a save without a coordinator do not form one save: fragments of two
    saves, one rank's twice, or fragments that disagree on how many ranks saved."""


class StorageError(CheckpointError):
    """The storage backend failed (after retries) for a named object."""


class PerRankStateError(CheckpointError):
    """Per-rank state would be lost or silently collapsed."""


class UnsafeObjectError(CheckpointError):
    """A saved object needs a type the safe loader does not allow."""


class DrainError(CheckpointError):
    """A background upload to the durable tier failed; the fast-tier copy is kept."""


# torch's dcp.load turns an exception from StorageReader.read_metadata into a bare AssertionError
# that only carries its text. The Reader records what it raised there, so ``ckptio.unwrap`` can
# give back the specific class (on the rank that raised it).
_RECENT_METADATA_ERRORS: dict[str, CheckpointError] = {}


def remember_metadata_error(exc: CheckpointError) -> None:
    _RECENT_METADATA_ERRORS[str(exc)] = exc
    while len(_RECENT_METADATA_ERRORS) > 16:
        _RECENT_METADATA_ERRORS.pop(next(iter(_RECENT_METADATA_ERRORS)))


def recall_metadata_error(text: str) -> CheckpointError | None:
    """The ckptio error whose message ``text`` (torch's wrapper message) quotes, if this process raised it."""
    return next((exc for message, exc in reversed(_RECENT_METADATA_ERRORS.items()) if message in text), None)
