"""What every object store shares (S3, GCS, Azure Blob): each request retried by ``retry.with_retries``
under the process's adaptive limit on requests in flight (``throttle.py``), on fsspec's event loop;
ranged reads in parallel, each copied into its buffers as the body arrives; data objects streamed as
parts sent in parallel (``PartStream``). A backend says how one request is made and what its answers
mean (``s3.py``, ``gcs.py``, ``azure.py``)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import secrets
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import fsspec
from fsspec.asyn import sync

from ckptio.config import StorageConfig
from ckptio.errors import CheckpointNotFoundError, StorageError
from ckptio.storage.base import FsspecStore, RangeRequest, ReadRequest
from ckptio.storage.retry import store_answer, with_retries
from ckptio.storage.throttle import AdaptiveLimit, limit_for

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The object ``check_conditional_writes`` creates twice (and deletes) in a checkpoint's folder.
PROBE_PREFIX = ".ckptio-precondition-probe."
_conditional_writes_proven: set = set()
_warned_without_preconditions: set = set()


class PreconditionFailed(Exception):
    """A conditional request found the object in a state it did not allow."""


class ObjectStore(FsspecStore):
    """A bucket (or container) and a key prefix; the root is ``bucket/prefix``."""

    #: The operation a ranged read is reported as (``_translate`` tells a missing bucket on a read by it).
    read_operation = "read"
    #: The operations that read (a missing bucket there: nothing to load, ``missing_bucket``).
    read_operations: tuple[str, ...] = ("read",)
    #: What the store calls the bucket a URL names, and where besides the URL to look for it.
    bucket_word, bucket_home = "bucket", "the endpoint"

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str, config: StorageConfig):
        super().__init__(fs, root, url, config)
        self.bucket, _, self.prefix = self.root.partition("/")
        self.part_size = config.part_size
        self.concurrency = config.max_concurrency
        self.attempts = config.retry_attempts
        self.deadline_s = config.retry_deadline_s
        self._limit: AdaptiveLimit | None = None

    def key(self, name: str) -> str:
        return self.path(name).partition("/")[2]

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.fs.loop

    # --- what a backend provides ------------------------------------------------------
    async def endpoint(self) -> str:
        """The service's address (the adaptive limit is per endpoint and bucket)."""
        raise NotImplementedError

    def _translate(self, exc: BaseException, operation: str, name: str) -> BaseException:
        """``exc`` as ckptio's error: ``FileNotFoundError``, ``PreconditionFailed``, or a ``StorageError``
        that says what to do."""
        raise NotImplementedError

    async def _get_range(self, name: str, start: int, end: int, into: Sequence[memoryview] | None) -> Any:
        """Bytes ``start`` to ``end`` of ``name``: returned, or copied into ``into`` (the count returned)."""
        raise NotImplementedError

    # --- requests ---------------------------------------------------------------------
    async def limit(self) -> AdaptiveLimit:
        """This process's adaptive limit on requests in flight to this bucket (``throttle.py``)."""
        if self._limit is None:
            endpoint = await self.endpoint()
            self._limit = limit_for(asyncio.get_running_loop(), endpoint, self.bucket, self.concurrency)
        return self._limit

    async def retried(self, operation: str, name: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()`` under the adaptive limit, retried by the one policy (``retry.py``)."""
        limit = await self.limit()

        async def limited() -> T:
            async with limit.slot():
                return await attempt()

        return await with_retries(
            limited, attempts=self.attempts, deadline_s=self.deadline_s, what=f"{operation} {self.describe(name)}"
        )

    def _sync(self, operation: str, name: str, fn: Any, *args: Any, **params: Any) -> Any:
        """Run coroutine function ``fn`` on fsspec's loop and wait for it; its errors as ckptio's."""
        try:
            return sync(self.loop, fn, *args, **params)
        except Exception as exc:
            raise self._translate(exc, operation, name) from exc

    def missing_bucket(self, operation: str, name: str) -> StorageError | CheckpointNotFoundError:
        """The bucket does not exist: nothing to load for a read, else nowhere to save."""
        kind = CheckpointNotFoundError if operation in self.read_operations else StorageError
        return kind(
            f"{self.bucket_word} {self.bucket!r} does not exist ({operation} {self.describe(name)}); check the URL "
            f"and {self.bucket_home}, or create the {self.bucket_word} first"
        )

    def access_denied(
        self, operation: str, name: str, answer: tuple[str, int | None], credentials: str
    ) -> StorageError:
        code, status = answer
        return StorageError(
            f"access denied: {operation} {self.describe(name)} ({status} {code}); check the credentials "
            f"({credentials}) and that they hold the permissions docs/stores.md lists"
        )

    def failed_after_retries(self, operation: str, name: str, exc: BaseException) -> StorageError:
        return StorageError(
            f"{operation} {self.describe(name)} failed after retries (up to {self.attempts} attempts within "
            f"{self.deadline_s:.0f}s): {type(exc).__name__}: {exc}"
        )

    # --- listings: the filesystem's own calls, under the one policy and its deadline ----------
    def _fs_call(self, operation: str, call: Callable[[], Awaitable[T]]) -> T:
        """A call of the filesystem's own (s3fs, gcsfs, adlfs), retried and bounded by the deadline like
        ckptio's requests (the filesystem's own timeouts and retries may wait far longer); its errors as
        the filesystem raises them (``_guard`` words them)."""
        return sync(self.loop, self.retried, operation, "", call)

    def _find_files(self) -> dict[str, dict]:
        self._forget_listings()
        return self._fs_call("list", lambda: self.fs._find(self.root, detail=True))

    def _list_root(self) -> list[str]:
        self._forget_listings()
        return self._fs_call("list", lambda: self.fs._ls(self.root, detail=False))

    def _remove_tree(self) -> None:
        self._fs_call("delete", lambda: self.fs._rm(self.root, recursive=True))

    def exists(self, name: str) -> bool:
        try:
            self.size(name)
            return True
        except FileNotFoundError:
            return False

    async def _delete(self, name: str) -> None:
        """Delete ``name``, retried (absent: ``FileNotFoundError``)."""
        raise NotImplementedError

    def remove(self, name: str) -> None:
        try:
            self._sync("delete", name, self._delete, name)
        except FileNotFoundError:
            pass

    def delete_best_effort(self, names: Sequence[str]) -> None:
        """Delete ``names`` at once (a composed object's parts: a request each), logging what fails."""

        async def delete(name: str) -> None:
            try:
                await self._delete(name)
            except Exception as exc:  # noqa: BLE001 - cleanup must not fail the save
                error = self._translate(exc, "delete", name)
                if not isinstance(error, FileNotFoundError):
                    log.warning("ckptio: could not delete %s: %s", self.describe(name), error)

        async def delete_all() -> None:
            await asyncio.gather(*(delete(name) for name in names))

        sync(self.loop, delete_all)

    # --- the commit ----------------------------------------------------------------------
    def _create_only(self, name: str, data: bytes) -> None:
        """Write ``name`` with the store's create-only precondition (``precondition``): raise
        ``PreconditionFailed`` where it exists."""
        raise NotImplementedError

    def put_if_absent(self, name: str, data: bytes) -> None:
        """A create-only write: the store refuses it atomically if ``name`` exists (``FileExistsError``).
        A store that answers the precondition 501 Not Implemented gets the generic check-then-write
        (racy), with one warning per process and bucket."""
        try:
            self._create_only(name, data)
        except PreconditionFailed:
            raise FileExistsError(self.describe(name)) from None
        except StorageError as exc:
            code, status = store_answer(exc.__cause__) or ("", None)
            if code not in ("NotImplemented", "501") and status != 501:
                raise
            key = (type(self), self.bucket)
            if key not in _warned_without_preconditions:
                _warned_without_preconditions.add(key)
                log.warning(
                    "ckptio: %s does not implement create-only writes (%s answered 501); committing by a check, "
                    "then a write: two jobs saving to one URL at once could both commit",
                    self.url,
                    self.precondition,
                )
            super().put_if_absent(name, data)

    # --- before a save -----------------------------------------------------------------
    def check_save_target(self) -> None:
        if not self.prefix.strip("/"):
            raise StorageError(
                f"{self.url}: a checkpoint needs a folder inside the {self.bucket_word}, e.g. "
                f"{self.url.rstrip('/')}/run/step-100; at its root it would share the {self.bucket_word} with "
                f"everything else there, and deleting it would empty the {self.bucket_word}. Nothing was saved"
            )

    def check_conditional_writes(self) -> None:
        """Before a save writes anything: prove once per process and bucket that the store refuses a
        create-only write over an existing object (an emulator or gateway may ignore the precondition,
        and then two jobs saving to one URL would both commit). A probe object is created twice, then
        deleted; a second create that succeeds is a ``StorageError``."""
        key = (type(self), self.loop, id(self.fs), self.bucket)
        if key in _conditional_writes_proven:
            return
        probe = f"{PROBE_PREFIX}{secrets.token_hex(8)}"
        try:
            self.put_if_absent(probe, b"ckptio checks that this store honours create-only writes")
            try:
                self.put_if_absent(probe, b"a second create, which the store must refuse")
            except FileExistsError:
                _conditional_writes_proven.add(key)
                return
        finally:
            self.delete_best_effort([probe])
        raise StorageError(
            f"{self.url}: the store accepted a second create-only write of {self.describe(probe)} "
            f"({self.precondition}): it ignores the precondition, so two jobs saving to one URL could both commit. "
            "Nothing was saved. Use a store or emulator version that honours it (docs/stores.md)"
        )

    #: The store's create-only precondition, as its documentation spells it.
    precondition = "If-None-Match: *"

    # --- reads ------------------------------------------------------------------------
    def prepare_directory(self) -> None:
        """Object stores have no directories: nothing to create, no request to make."""

    def read_ranges(self, requests: Sequence[RangeRequest]) -> list[bytes]:
        return self._get_all([(r.name, r.start, r.end, None) for r in requests])

    def read_into(self, requests: Sequence[ReadRequest]) -> list[int]:
        """Each request one ranged GET, its body copied into the buffers as it arrives (no joined
        copy of the whole range first)."""
        return self._get_all([(r.name, r.offset, r.offset + r.length, r.buffers) for r in requests])

    def _get_all(self, requests: list[tuple[str, int, int, Sequence[memoryview] | None]]) -> list:
        if not requests:
            return []

        async def fetch_all() -> list:
            # at most max_concurrency GETs in flight, fewer while the store throttles (``throttle.py``)
            return await asyncio.gather(*(self._get_range(*r) for r in requests))

        return self._sync(self.read_operation, requests[0][0], fetch_all)


class BufferFiller:
    """A writable stream that fills ``buffers`` in order with what it is given (``write``), refusing more
    than they hold; ``filled`` counts the bytes received."""

    def __init__(self, buffers: Sequence[memoryview], where: str):
        self.buffers, self.where = buffers, where
        self.index, self.at, self.filled = 0, 0, 0

    def write(self, data: Any) -> int:
        chunk = memoryview(data).cast("B")
        received = len(chunk)
        while len(chunk):
            if self.index == len(self.buffers):
                raise StorageError(f"GET {self.where} returned more bytes than the range asked for")
            buffer = self.buffers[self.index]
            n = min(len(chunk), len(buffer) - self.at)
            buffer[self.at : self.at + n] = chunk[:n]
            chunk, self.at, self.filled = chunk[n:], self.at + n, self.filled + n
            if self.at == len(buffer):
                self.index, self.at = self.index + 1, 0
        return received


async def read_chunks_into(chunks: AsyncIterator[memoryview], buffers: Sequence[memoryview], where: str) -> int:
    """Copy a GET's body into ``buffers`` chunk by chunk as it arrives; return the bytes received
    (fewer than the buffers hold at the end of the object)."""
    filler = BufferFiller(buffers, where)
    async for chunk in chunks:
        filler.write(chunk)
    return filler.filled


async def aiohttp_chunks(content: Any) -> AsyncIterator[memoryview]:
    """The chunks of an aiohttp ``StreamReader`` as they arrive."""
    while chunk := await content.readany():
        yield memoryview(chunk)


class PartStream:
    """A data object written front to back and sent as parts in parallel: at most ``max_concurrency``
    in flight, bounding memory. A part leaves only once a quarter part more is buffered, so the tail
    joins the last part instead of costing a request of its own; an object that stays under 1.25 parts
    (or ``single_upload_parts``) goes up as one request at ``close``.

    Nothing is copied here: a part is the list of views of the written pieces it spans (the one piece
    that straddles a part boundary is split as two views, without a CRC32C), sent as they are. Written
    data must therefore stay unchanged until ``close`` returns (``Sink``)."""

    #: The most bytes one part may hold.
    max_part_bytes = 5 << 30
    #: An object of at most this many parts goes up as one request at ``close`` (0: only one that stays
    #: under 1.25 parts); parts start once more is written.
    single_upload_parts = 0

    def __init__(self, store: ObjectStore, name: str):
        self.store, self.name = store, name
        self.pending: collections.deque[tuple[memoryview, int | None]] = collections.deque()  # (data, CRC32C)
        self.pending_bytes = 0
        self.parts: list[concurrent.futures.Future] = []

    def next_part_size(self) -> int:
        return self.store.part_size

    def write(self, data: bytes | memoryview, crc: int | None = None) -> None:
        view = memoryview(data).cast("B")
        if not len(view):
            return
        self.pending.append((view, crc))
        self.pending_bytes += len(view)
        if not self.parts and self.pending_bytes <= self.single_upload_parts * self.next_part_size():
            return
        while True:
            size = self.next_part_size()
            if self.pending_bytes < min(size + size // 4, self.max_part_bytes):
                return
            self.send_part(self.take(size))

    def take(self, size: int) -> list[tuple[memoryview, int | None]]:
        """The pending pieces that make up the next ``size`` bytes."""
        pieces, need = [], size
        while need:
            head, crc = self.pending[0]
            if len(head) <= need:
                pieces.append(self.pending.popleft())
                need -= len(head)
            else:
                pieces.append((head[:need], None))
                self.pending[0] = (head[need:], None)
                need = 0
        self.pending_bytes -= size
        return pieces

    def take_rest(self) -> list[tuple[memoryview, int | None]]:
        pieces = list(self.pending)
        self.pending.clear()
        self.pending_bytes = 0
        return pieces

    def send_part(self, pieces: list[tuple[memoryview, int | None]]) -> None:
        raise NotImplementedError

    def submit(self, coro: Awaitable[Any]) -> None:
        """Start one part's upload once fewer than ``max_concurrency`` are in flight; a part that
        failed surfaces now, not at the end."""
        in_flight = [f for f in self.parts if not f.done()]
        if len(in_flight) >= self.store.concurrency:
            concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
        for done in (f for f in self.parts if f.done()):
            done.result()
        self.parts.append(asyncio.run_coroutine_threadsafe(coro, self.store.loop))

    def send_last_part(self, pieces: list[tuple[memoryview, int | None]], operation: str) -> None:
        try:
            self.send_part(pieces)
        except Exception as exc:
            raise self.store._translate(exc, operation, self.name) from exc

    def results(self, operation: str) -> list[Any]:
        """Every part's answer, in order; the first failure as ckptio's error."""
        try:
            return [f.result() for f in self.parts]
        except Exception as exc:
            raise self.store._translate(exc, operation, self.name) from exc

    def cancel_parts(self) -> None:
        for f in self.parts:
            f.cancel()
        concurrent.futures.wait(self.parts)
        self.pending.clear()
        self.pending_bytes = 0
