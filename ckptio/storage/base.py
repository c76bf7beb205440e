"""Where and how bytes land: the generic fsspec store every backend starts from.

A store is rooted at one checkpoint directory (or key prefix) and speaks in plain names
inside it. Backends override only what they do differently (``local.py``, ``s3.py``).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Protocol, Sequence

import fsspec

from ..errors import StorageError

log = logging.getLogger(__name__)


class Sink(Protocol):
    """A data file being written front to back."""

    def write(self, data: bytes | memoryview) -> None: ...

    def close(self) -> None:
        """Make the file durable under its final name."""

    def abort(self) -> None:
        """Give up: leave nothing behind (or as little as the backend allows)."""


class RangeRequest(tuple):
    """``(name, start, end)``: bytes ``start`` up to ``end`` (exclusive) of a file."""

    __slots__ = ()

    def __new__(cls, name: str, start: int, end: int) -> "RangeRequest":
        return super().__new__(cls, (name, start, end))


MAX_MERGED_READ = 64 << 20


class ReadInto(NamedTuple):
    """Fill ``buffer`` with the bytes of file ``name`` starting at ``offset``."""

    name: str
    offset: int
    buffer: memoryview


class FsspecStore:
    """Any fsspec filesystem: plain opens, puts and ``cat_ranges``."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str, config: Any = None):
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.config = config

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def describe(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"

    # --- metadata-sized objects -------------------------------------------------------
    def exists(self, name: str) -> bool:
        return self._guard(name, "check", lambda: self.fs.exists(self.path(name)))

    def read(self, name: str) -> bytes:
        """Whole object; raises ``FileNotFoundError`` when it is absent."""
        return self._guard(name, "read", lambda: self.fs.cat_file(self.path(name)), passthrough=(FileNotFoundError,))

    def put_atomic(self, name: str, data: bytes) -> None:
        """Publish ``data`` under ``name`` all at once (a single PUT on object stores)."""
        self._guard(name, "write", lambda: self.fs.pipe_file(self.path(name), data))

    def list_names(self) -> list[str] | None:
        """Names directly under the root, or ``None`` when the root does not exist."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - listing is diagnostic only
            log.debug("listing %s failed: %r", self.url, exc)
            return None
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def delete(self, names: Sequence[str]) -> None:
        for name in names:
            try:
                self.fs.rm_file(self.path(name))
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - cleanup of superseded files must not fail a commit
                log.warning("ckptio: could not delete superseded %s: %r", self.describe(name), exc)

    # --- data files -------------------------------------------------------------------
    def prepare_directory(self) -> None:
        self._guard("", "create", lambda: self.fs.makedirs(self.root, exist_ok=True))

    def open_sink(self, name: str) -> Sink:
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

    def read_into(self, reads: Sequence[ReadInto]) -> list[int]:
        """Fill each buffer; return how many bytes each got (fewer at end of file).
        Raises ``FileNotFoundError`` for a missing file.

        Reads that touch in the same file are fetched as one ranged request (up to
        ``MAX_MERGED_READ`` bytes), since on remote stores requests cost more than copies."""
        order = sorted(range(len(reads)), key=lambda i: (reads[i].name, reads[i].offset))
        groups: list[list[int]] = []
        for i in order:
            last = groups[-1] if groups else None
            if last:
                prev, first = reads[last[-1]], reads[last[0]]
                end = prev.offset + len(prev.buffer)
                if (
                    prev.name == reads[i].name
                    and end == reads[i].offset
                    and end + len(reads[i].buffer) - first.offset <= MAX_MERGED_READ
                ):
                    last.append(i)
                    continue
            groups.append([i])
        requests = [
            RangeRequest(reads[g[0]].name, reads[g[0]].offset, reads[g[-1]].offset + len(reads[g[-1]].buffer))
            for g in groups
        ]
        counts = [0] * len(reads)
        for group, request, data in zip(groups, requests, self.read_ranges(requests)):
            data = memoryview(data)
            for i in group:
                at = reads[i].offset - request[1]
                piece = data[at : at + len(reads[i].buffer)]
                reads[i].buffer[: len(piece)] = piece
                counts[i] = len(piece)
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


class _FileSink:
    def __init__(self, store: FsspecStore, name: str, handle: Any):
        self.store, self.name, self.handle = store, name, handle

    def write(self, data: bytes | memoryview) -> None:
        self.store._guard(self.name, "write", lambda: self.handle.write(data))

    def close(self) -> None:
        self.store._guard(self.name, "finish", self.handle.close)

    def abort(self) -> None:
        discard = getattr(self.handle, "discard", None)
        try:
            discard() if discard else self.handle.close()
        except Exception:  # noqa: BLE001
            pass
        self.store.delete([self.name])
