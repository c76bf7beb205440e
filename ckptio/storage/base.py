"""Where and how bytes land: the generic fsspec store every backend starts from.

A store is rooted at one checkpoint directory (or key prefix) and speaks in plain names
inside it. Backends override only what they do differently (``local.py``, ``s3.py``).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Protocol, Sequence

import fsspec

from ckptio.config import LOCAL_REQUEST_COST_BYTES, REMOTE_READ_GAP_BYTES, REMOTE_REQUEST_COST_BYTES, StorageConfig
from ckptio.errors import CheckpointError, StorageError
from ckptio.format.names import SIBLING_PREFIX

log = logging.getLogger(__name__)


class Sink(Protocol):
    """A data file being written front to back."""

    def write(self, data: bytes | memoryview, crc: int | None = None) -> None:
        """Append ``data``, which must stay unchanged until ``close`` returns: a sink may send it
        from where it is instead of copying it (``s3.MultipartSink`` does). ``crc``: its CRC32C, when
        the caller has it (an S3 sink derives each part's CRC32C from them instead of reading it)."""

    def close(self) -> None:
        """Make the file durable under its final name."""

    def abort(self) -> None:
        """Give up: leave nothing behind (or as little as the backend allows)."""


class RangeRequest(NamedTuple):
    """Bytes ``start`` up to ``end`` (exclusive) of file ``name``."""

    name: str
    start: int
    end: int


class ReadRequest(NamedTuple):
    """One ranged read: the bytes of file ``name`` from ``offset`` on fill ``buffers`` in order.
    Stores issue each request as it is (one ranged GET, one preadv); which reads are merged into
    one request is decided by the reader (``ranges.plan_requests``), never here."""

    name: str
    offset: int
    buffers: tuple[memoryview, ...]

    @property
    def length(self) -> int:
        return sum(len(b) for b in self.buffers)


class FsspecStore:
    """Any fsspec filesystem: plain opens, puts and ``cat_ranges``."""

    #: Reads of one file at most this many bytes apart are worth one request (``config.py``).
    read_gap_bytes = REMOTE_READ_GAP_BYTES
    #: Whether requests cross a network (``sources.ByteSource.remote``).
    remote = True

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str, config: StorageConfig):
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.config = config
        if config.read_gap_bytes is not None:
            self.read_gap_bytes = config.read_gap_bytes

    @property
    def request_cost_bytes(self) -> int:
        """Bytes whose reading costs about what one more read request does (``config.py``): a read gap
        set in the config says just that, else the store's kind decides."""
        if self.config.read_gap_bytes is not None:
            return self.config.read_gap_bytes
        return REMOTE_REQUEST_COST_BYTES if self.remote else LOCAL_REQUEST_COST_BYTES

    def path(self, name: str) -> str:
        return _beside(self.root, name)

    def describe(self, name: str) -> str:
        return _beside(self.url.rstrip("/"), name)

    def sibling(self, name: str) -> "FsspecStore":
        """The store of the checkpoint folder ``name`` beside this one (same filesystem and settings)."""
        root, url = _beside(self.root, SIBLING_PREFIX + name), _beside(self.url.rstrip("/"), SIBLING_PREFIX + name)
        return type(self)(self.fs, root, url, self.config)

    # --- metadata-sized objects -------------------------------------------------------
    def exists(self, name: str) -> bool:
        return self._guard(name, "check", lambda: self.fs.exists(self.path(name)))

    def size(self, name: str) -> int:
        """Size in bytes; raises ``FileNotFoundError`` when it is absent."""
        return int(self._guard(name, "check", lambda: self.fs.size(self.path(name)), passthrough=(FileNotFoundError,)))

    def read(self, name: str) -> bytes:
        """Whole object; raises ``FileNotFoundError`` when it is absent."""
        return self._guard(name, "read", lambda: self.fs.cat_file(self.path(name)), passthrough=(FileNotFoundError,))

    def put_atomic(self, name: str, data: bytes) -> None:
        """Publish ``data`` under ``name`` all at once (a single PUT on object stores)."""
        self._guard(name, "write", lambda: self.fs.pipe_file(self.path(name), data))

    def put_if_absent(self, name: str, data: bytes) -> None:
        """Publish like ``put_atomic``, unless ``name`` exists: then raise ``FileExistsError``.
        Generic fsspec filesystems have no conditional write: this checks, then writes (racy)."""
        if self.exists(name):
            raise FileExistsError(self.describe(name))
        self.put_atomic(name, data)

    def check_save_target(self) -> None:
        """Before a save looks at its target: object stores refuse a bucket's root (``object_store.py``)."""

    def check_conditional_writes(self) -> None:
        """Object stores prove their create-only precondition before a save (``object_store.py``)."""

    def list_names(self, strict: bool = False, nested: bool = False) -> list[str] | None:
        """Names directly under the root (``nested``: of every file below it, a data file under its key
        prefix as ``xx/data-....ckio``), or ``None`` when the root does not exist. A failed listing is
        ``None`` too (diagnostics), or ``StorageError`` when ``strict``."""
        try:
            if nested:
                return sorted(self._files_below(self._find_files()))
            entries = self._list_root()
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - listing is diagnostic unless strict
            if strict:
                raise StorageError(f"cannot list {self.url}: {type(exc).__name__}: {exc}") from exc
            log.debug("listing %s failed: %r", self.url, exc)
            return None
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def list_sizes(self) -> dict[str, int] | None:
        """Name -> size of every file below the root (a data file under its key prefix as
        ``xx/data-....ckio``), listed afresh (not from a cache: another process may have written
        since; on S3 one listing without a delimiter); ``None`` when the root does not exist."""
        try:
            entries = self._guard("", "list", self._find_files, passthrough=(FileNotFoundError,))
        except FileNotFoundError:
            return None
        return self._files_below(entries)

    def _find_files(self) -> dict[str, dict]:
        """``fs.find`` of the root, with details, listed afresh (object stores: under the retry policy)."""
        self._forget_listings()
        return self.fs.find(self.root, detail=True)

    def _list_root(self) -> list[str]:
        """The paths directly under the root, listed afresh."""
        self._forget_listings()
        return self.fs.ls(self.root, detail=False)

    def _forget_listings(self) -> None:
        """Drop the filesystem's cached listings below the root: others write there too, and a cached
        answer never changes (adlfs ignores ``ls``'s ``refresh``; a merge polling it waited out its
        600 s for fragments long there)."""
        self.fs.invalidate_cache(self.root)

    def _remove_tree(self) -> None:
        self.fs.rm(self.root, recursive=True)

    def _files_below(self, entries: dict[str, dict]) -> dict[str, int]:
        """``fs.find(root, detail=True)``'s files as names relative to the root, with their sizes."""
        root = self.fs._strip_protocol(self.root).rstrip("/") + "/"
        return {
            path[len(root) :]: int(info.get("size") or 0)
            for path, info in entries.items()
            if info.get("type") != "directory" and path.startswith(root)
        }

    def open_uploads(self) -> list[tuple[str, str]]:
        """``(name, upload id)`` of unfinished multipart uploads under the root (object stores only)."""
        return []

    def abort_upload(self, name: str, upload_id: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no multipart uploads")

    def delete_best_effort(self, names: Sequence[str]) -> None:
        """Delete ``names``, logging what fails: only for cleanup that must not fail a commit (superseded
        files, a failed save's partial file). ``remove`` raises instead."""
        for name in names:
            try:
                self.fs.rm_file(self.path(name))
                self._tidy_folder_of(name)
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - cleanup of superseded files must not fail a commit
                log.warning("ckptio: could not delete superseded %s: %r", self.describe(name), exc)

    def remove(self, name: str) -> None:
        """Delete ``name`` (absent is fine); unlike ``delete``, a failure raises ``StorageError``."""
        try:
            self._guard(name, "delete", lambda: self.fs.rm_file(self.path(name)), passthrough=(FileNotFoundError,))
        except FileNotFoundError:
            return
        self._tidy_folder_of(name)

    def _tidy_folder_of(self, name: str) -> None:
        """After ``name`` went: object stores have no folders to remove (``LocalStore`` removes an empty
        key-prefix folder)."""

    def remove_all(self) -> None:
        """Delete every object under the root, and the root itself (absent is fine)."""
        try:
            self._guard("", "delete", self._remove_tree, passthrough=(FileNotFoundError,))
        except FileNotFoundError:
            pass

    # --- data files -------------------------------------------------------------------
    def prepare_directory(self) -> None:
        self._guard("", "create", lambda: self.fs.makedirs(self.root, exist_ok=True))

    def open_sink(self, name: str) -> Sink:
        if "/" in name:  # a data file under its key prefix (a no-op on object stores)
            self._guard(name, "create", lambda: self.fs.makedirs(self.path(name).rsplit("/", 1)[0], exist_ok=True))
        handle = self._guard(name, "open", lambda: self.fs.open(self.path(name), "wb"))
        return _FileSink(self, name, handle)

    def read_ranges(self, requests: Sequence[RangeRequest]) -> list[bytes]:
        if not requests:
            return []
        paths = [self.path(n) for n, _, _ in requests]
        starts = [s for _, s, _ in requests]
        ends = [e for _, _, e in requests]
        return self._guard(
            requests[0][0],
            "read",
            lambda: self.fs.cat_ranges(paths, starts, ends, on_error="raise"),
            passthrough=(FileNotFoundError,),
        )

    def read_into(self, requests: Sequence[ReadRequest]) -> list[int]:
        """Fill each request's buffers; return how many bytes each request got (fewer at end of
        file). Raises ``FileNotFoundError`` for a missing file."""
        counts = []
        for request, data in zip(requests, self.read_ranges([_as_range(r) for r in requests]), strict=True):
            data, at = memoryview(data), 0
            for buffer in request.buffers:
                piece = data[at : at + len(buffer)]
                buffer[: len(piece)] = piece
                at += len(piece)
            counts.append(len(data))
        return counts

    # --- errors -----------------------------------------------------------------------
    def _guard(self, name: str, action: str, fn, passthrough: tuple = ()):
        try:
            return fn()
        except passthrough:
            raise
        except PermissionError as exc:
            raise StorageError(
                f"permission denied to {action} {self.describe(name)}: {exc}. Check the path's permissions "
                "or the credentials in storage_options / the AWS environment."
            ) from exc
        except FileNotFoundError as exc:
            raise StorageError(
                f"cannot {action} {self.describe(name)}: {exc} (does the bucket or directory exist?)"
            ) from exc
        except StorageError:
            raise
        except Exception as exc:
            raise StorageError(f"failed to {action} {self.describe(name)}: {type(exc).__name__}: {exc}") from exc


def _beside(root: str, name: str) -> str:
    """``root/name``; a sibling checkpoint's file (``../<sibling>/...``, an incremental checkpoint's
    reference, its folder name checked by the decoder) resolved in ``root``'s parent folder: object
    stores take '..' as part of a key."""
    if not name.startswith(SIBLING_PREFIX):
        return f"{root}/{name}"
    parent, _, _ = root.rpartition("/")
    if not parent or parent.endswith(":/") or parent.endswith(":"):
        raise CheckpointError(
            f"{root}/{name}: a checkpoint at the top of its bucket or filesystem has no sibling folders to reference"
        )
    return f"{parent}/{name[len(SIBLING_PREFIX) :]}"


def _as_range(request: ReadRequest) -> RangeRequest:
    return RangeRequest(request.name, request.offset, request.offset + request.length)


class _FileSink:
    def __init__(self, store: FsspecStore, name: str, handle: Any):
        self.store, self.name, self.handle = store, name, handle

    def write(self, data: bytes | memoryview, crc: int | None = None) -> None:
        self.store._guard(self.name, "write", lambda: self.handle.write(data))

    def close(self) -> None:
        self.store._guard(self.name, "finish", self.handle.close)

    def abort(self) -> None:
        discard = getattr(self.handle, "discard", None)
        try:
            discard() if discard else self.handle.close()
        except Exception:  # noqa: BLE001
            pass
        self.store.delete_best_effort([self.name])
