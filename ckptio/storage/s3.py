"""S3 specifics: data objects streamed as parallel multipart uploads under their final key
(no temp objects, no rename), single PUTs for small objects, parallel ranged GETs, and
every request retried by ``retry.with_retries``. Requests go through s3fs's aiobotocore client,
configured so botocore does not retry on its own: one policy, one place."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, Sequence

import fsspec
from fsspec.asyn import sync

from ..config import StorageConfig
from ..errors import CheckpointNotFoundError, StorageError
from .base import FsspecStore, RangeRequest
from .retry import with_retries

log = logging.getLogger(__name__)

#: S3's limits on one object: parts per multipart upload, bytes per part (and per single PUT).
MAX_PARTS = 10_000
MAX_PART_BYTES = 5 << 30
#: Part sizes double every this many parts (up to MAX_PART_BYTES), so a streamed object of unknown
#: size never needs more than MAX_PARTS: 10,000 parts hold 4.8 TiB even at the 5 MiB minimum part
#: size, and the default part size reaches S3's 5 TiB object limit within them.
PARTS_PER_SIZE_STEP = 1000


def part_size_for(number: int, base: int) -> int:
    """Size of part ``number`` (1-based) of an upload whose first parts are ``base`` bytes."""
    return min(base << ((number - 1) // PARTS_PER_SIZE_STEP), MAX_PART_BYTES)


def s3_storage_options(storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """The user's options, with botocore's own retries off unless the user configured them."""
    options = dict(storage_options or {})
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
    options["config_kwargs"] = config
    return options


class S3Store(FsspecStore):
    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str, config: StorageConfig):
        super().__init__(fs, root, url, config)
        self.bucket, _, self.prefix = root.partition("/")
        self.part_size = config.part_size
        self.concurrency = config.max_concurrency
        self.attempts = config.retry_attempts
        self.deadline_s = config.retry_deadline_s

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    # --- the request primitive ----------------------------------------------------------
    async def _request(self, operation: str, name: str, **params: Any) -> Any:
        if self.fs._s3 is None:
            await self.fs.set_session()
        client = self.fs._s3

        async def attempt() -> Any:
            response = await getattr(client, operation)(Bucket=self.bucket, **params)
            if operation == "get_object":
                async with response["Body"] as body:
                    return await body.read()
            return response

        return await with_retries(
            attempt, attempts=self.attempts, deadline_s=self.deadline_s, what=f"{operation} {self.describe(name)}"
        )

    def _run(self, operation: str, name: str, **params: Any) -> Any:
        try:
            return sync(self.fs.loop, self._request, operation, name, **params)
        except Exception as exc:
            raise self._translate(exc, operation, name) from exc

    def _translate(self, exc: BaseException, operation: str, name: str) -> BaseException:
        if isinstance(exc, StorageError):
            return exc
        error = (getattr(exc, "response", None) or {}).get("Error", {})
        code = str(error.get("Code", ""))
        if code in ("NoSuchKey", "404", "NotFound"):
            return FileNotFoundError(self.describe(name))
        if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
            return _PreconditionFailed(self.describe(name))
        if code == "NoSuchBucket":
            kind = CheckpointNotFoundError if operation in ("get_object", "head_object") else StorageError
            return kind(
                f"bucket {self.bucket!r} does not exist ({operation} {self.describe(name)}); check the URL "
                "and the endpoint, or create the bucket first"
            )
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return StorageError(
                f"access denied: {operation} {self.describe(name)} ({code}); check the credentials and region in "
                "storage_options or the AWS environment, and the bucket policy"
            )
        return StorageError(
            f"{operation} {self.describe(name)} failed after retries (up to {self.attempts} attempts within "
            f"{self.deadline_s:.0f}s): {type(exc).__name__}: {exc}"
        )

    # --- small objects ------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        try:
            self._run("head_object", name, Key=self.key(name))
            return True
        except FileNotFoundError:
            return False

    def read(self, name: str) -> bytes:
        return self._run("get_object", name, Key=self.key(name))

    def size(self, name: str) -> int:
        return int(self._run("head_object", name, Key=self.key(name))["ContentLength"])

    def put_atomic(self, name: str, data: bytes) -> None:
        self._run("put_object", name, Key=self.key(name), Body=data)

    def put_if_absent(self, name: str, data: bytes) -> None:
        """A conditional PUT (``If-None-Match: *``): S3 refuses it if the key exists, atomically.
        S3-compatible stores without conditional writes get the generic check-then-write (racy)."""
        try:
            self._run("put_object", name, Key=self.key(name), Body=data, IfNoneMatch="*")
        except _PreconditionFailed:
            raise FileExistsError(self.describe(name)) from None
        except StorageError as exc:
            code = str((getattr(exc.__cause__, "response", None) or {}).get("Error", {}).get("Code", ""))
            if code not in ("NotImplemented", "501"):
                raise
            log.warning("ckptio: %s does not support conditional writes; committing without them (racy)", self.url)
            super().put_if_absent(name, data)

    def open_uploads(self) -> list[tuple[str, str]]:
        prefix = self.key("")
        found: list[tuple[str, str]] = []
        params: dict[str, Any] = {"Prefix": prefix}
        while True:
            page = self._run("list_multipart_uploads", "", **params)
            for upload in page.get("Uploads", []):
                name = upload["Key"][len(prefix) :]
                if "/" not in name:
                    found.append((name, upload["UploadId"]))
            if not page.get("IsTruncated"):
                return found
            params.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])

    def abort_upload(self, name: str, upload_id: str) -> None:
        self._run("abort_multipart_upload", name, Key=self.key(name), UploadId=upload_id)

    def delete(self, names: Sequence[str]) -> None:
        for name in names:
            try:
                self._run("delete_object", name, Key=self.key(name))
            except (FileNotFoundError, StorageError):
                pass

    def remove(self, name: str) -> None:
        try:
            self._run("delete_object", name, Key=self.key(name))
        except FileNotFoundError:
            pass

    def prepare_directory(self) -> None:
        """Object stores have no directories: nothing to create, no request to make."""

    # --- data objects -------------------------------------------------------------------
    def open_sink(self, name: str) -> "MultipartSink":
        return MultipartSink(self, name)

    def read_ranges(self, requests: Sequence[RangeRequest]) -> list[bytes]:
        if not requests:
            return []

        async def fetch_all() -> list[bytes]:
            gate = asyncio.Semaphore(self.concurrency)

            async def fetch(name: str, start: int, end: int) -> bytes:
                async with gate:
                    return await self._request("get_object", name, Key=self.key(name), Range=f"bytes={start}-{end - 1}")

            return await asyncio.gather(*(fetch(*r) for r in requests))

        try:
            return sync(self.fs.loop, fetch_all)
        except Exception as exc:
            raise self._translate(exc, "get_object", requests[0][0]) from exc


class _PreconditionFailed(Exception):
    """A conditional request found the object in a state it did not allow."""


class MultipartSink:
    """Streams one object: a single PUT if it stays under 1.25 x ``part_size``, otherwise a
    multipart upload whose parts go up in parallel (at most ``max_concurrency`` in flight,
    bounding memory). A part leaves only once a quarter part more is buffered, so the tail
    joins the last part instead of costing a request of its own (S3's last part may be any size).
    Part sizes grow with the part count (``part_size_for``) to stay within S3's limits."""

    def __init__(self, store: S3Store, name: str):
        self.store, self.name = store, name
        self.key = store.key(name)
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: list[concurrent.futures.Future] = []

    def write(self, data: bytes | memoryview) -> None:
        self.buffer += data
        while True:
            # The next part leaves once a quarter more than it is buffered (a short tail joins the
            # last part), but never past what one part or one PUT may hold.
            size = part_size_for(len(self.parts) + 1, self.store.part_size)
            if len(self.buffer) < min(size + size // 4, MAX_PART_BYTES):
                return
            with memoryview(self.buffer) as view:  # one copy of the part, not a slice and then a copy
                part = bytes(view[:size])
            del self.buffer[:size]
            self._send_part(part)

    def _send_part(self, body: bytes) -> None:
        if self.upload_id is None:
            response = self.store._run("create_multipart_upload", self.name, Key=self.key)
            self.upload_id = response["UploadId"]
        in_flight = [f for f in self.parts if not f.done()]
        if len(in_flight) >= self.store.concurrency:
            concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
        for done in (f for f in self.parts if f.done()):
            done.result()  # surface a failed part now, not at the end
        number = len(self.parts) + 1
        if number > MAX_PARTS:
            raise StorageError(
                f"{self.store.describe(self.name)} needs more than S3's {MAX_PARTS} parts per upload: "
                f"raise part_size (now {self.store.part_size} bytes) so that parts can hold this rank's data"
            )
        coro = self.store._request(
            "upload_part", self.name, Key=self.key, UploadId=self.upload_id, PartNumber=number, Body=body
        )
        self.parts.append(asyncio.run_coroutine_threadsafe(coro, self.store.fs.loop))

    def close(self) -> None:
        if self.upload_id is None:
            self.store._run("put_object", self.name, Key=self.key, Body=bytes(self.buffer))
            return
        try:
            if self.buffer:
                self._send_part(bytes(self.buffer))
            etags = [f.result()["ETag"] for f in self.parts]
        except Exception as exc:
            raise self.store._translate(exc, "upload_part", self.name) from exc
        parts = [{"ETag": etag, "PartNumber": i + 1} for i, etag in enumerate(etags)]
        self.store._run(
            "complete_multipart_upload",
            self.name,
            Key=self.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": parts},
        )

    def abort(self) -> None:
        for f in self.parts:
            f.cancel()
        concurrent.futures.wait(self.parts)
        if self.upload_id is not None:
            try:
                self.store._run("abort_multipart_upload", self.name, Key=self.key, UploadId=self.upload_id)
            except Exception:  # noqa: BLE001 - best effort; the original error matters more
                pass
