"""Azure Blob Storage: ckptio's requests through the async client of azure-storage-blob that adlfs builds
from the user's ``storage_options`` (adlfs's meaning: ``connection_string``, ``account_name`` with
``account_key``, ``sas_token`` or ``credential``; without them, ``DefaultAzureCredential``), every request
retried by ckptio's one policy (the SDK's own retries are off per request: ``retry_total=0``). The commit is
a create-only upload (``If-None-Match: *``); each upload carries its MD5 (``Content-MD5``), which the
service checks, computed in a worker thread (the SDK's ``validate_content`` hashes on the event loop, one
block at a time); data objects go up as blocks staged in parallel (Put Block, sent from the written pieces
without joining them), then committed in order (Put Block List)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import secrets
from typing import Any, Awaitable, Callable, Sequence

import fsspec

from ckptio.config import StorageConfig
from ckptio.errors import StorageError
from ckptio.storage.object_store import BufferFiller, ObjectStore, PartStream, PreconditionFailed
from ckptio.storage.request_body import RequestBody
from ckptio.storage.retry import store_answer

log = logging.getLogger(__name__)

#: Azure's limits: blocks per blob, bytes per block.
MAX_BLOCKS = 50_000
MAX_BLOCK_BYTES = 4000 << 20
#: Requests made here are retried by ``retry.with_retries`` alone.
NO_SDK_RETRIES = {"retry_total": 0}
#: The SDK splits a single upload above this many bytes into blocks of its own (its max_single_put_size):
#: a larger object goes up as blocks here, each with its own MD5.
MAX_SINGLE_PUT_BYTES = 64 << 20


def azure_filesystem(storage_options: dict[str, Any] | None) -> fsspec.AbstractFileSystem:
    """adlfs's filesystem for the user's options (adlfs reads ``AZURE_STORAGE_CONNECTION_STRING`` and
    ``AZURE_STORAGE_ACCOUNT_NAME`` too, and uses ``DefaultAzureCredential`` where nothing else is given)."""
    try:
        import adlfs
    except ImportError as exc:
        raise StorageError("az:// and abfs:// need adlfs, which is not installed: pip install 'ckptio[azure]'") from exc
    return adlfs.AzureBlobFileSystem(**dict(storage_options or {}))


class AzureStore(ObjectStore):
    read_operation = "download"
    read_operations = ("properties", "download")
    bucket_word, bucket_home = "container", "the account"

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str, config: StorageConfig):
        super().__init__(fs, root, url, config)
        self._container: Any = None

    def _blob(self, name: str) -> Any:
        if self._container is None:
            self._container = self.fs.service_client.get_container_client(self.bucket)
        return self._container.get_blob_client(self.key(name))

    async def endpoint(self) -> str:
        return str(self.fs.service_client.url)

    async def _call(self, operation: str, name: str, request: Callable[[Any], Awaitable[Any]]) -> Any:
        """``request(blob client)``, retried."""
        blob = self._blob(name)
        return await self.retried(operation, name, lambda: request(blob))

    def _run(self, operation: str, name: str, request: Callable[[Any], Awaitable[Any]]) -> Any:
        return self._sync(operation, name, self._call, operation, name, request)

    def _translate(self, exc: BaseException, operation: str, name: str) -> BaseException:
        if isinstance(exc, (StorageError, FileNotFoundError, PreconditionFailed)):
            return exc
        code, status = store_answer(exc) or ("", None)
        if code == "ContainerNotFound":
            return self.missing_bucket(operation, name)
        if status == 404:
            return FileNotFoundError(self.describe(name))
        if code == "BlobAlreadyExists" or status in (409, 412):
            return PreconditionFailed(self.describe(name))
        if status in (401, 403):
            return self.access_denied(
                operation,
                name,
                (code, status),
                "storage_options connection_string, account_name with account_key, sas_token or credential, "
                "or the environment DefaultAzureCredential reads",
            )
        return self.failed_after_retries(operation, name, exc)

    # --- small objects ------------------------------------------------------------------
    def size(self, name: str) -> int:
        return int(self._run("properties", name, lambda b: b.get_blob_properties(**NO_SDK_RETRIES)).size)

    def read(self, name: str) -> bytes:
        async def download(blob: Any) -> bytes:
            stream = await blob.download_blob(max_concurrency=1, **NO_SDK_RETRIES)
            return await stream.readall()

        return self._run("download", name, download)

    async def _send(self, operation: str, name: str, pieces: Sequence[Any], request: Callable[..., Any]) -> Any:
        """``request(blob client, headers)``, which sends the pieces back to back, with their ``Content-MD5``
        (hashed once, not per attempt), retried."""
        headers = {"Content-MD5": await content_md5(pieces)}
        return await self._call(operation, name, lambda b: request(b, headers))

    def _put(self, name: str, pieces: Sequence[Any], overwrite: bool) -> None:
        data = b"".join(pieces)  # upload_blob takes bytes: one copy (at most 1.25 parts and 64 MiB)

        def upload(blob: Any, headers: dict) -> Any:
            return blob.upload_blob(data, overwrite=overwrite, max_concurrency=1, headers=headers, **NO_SDK_RETRIES)

        self._sync("upload", name, self._send, "upload", name, [data], upload)

    def put_atomic(self, name: str, data: bytes) -> None:
        self._put(name, [data], overwrite=True)

    def _create_only(self, name: str, data: bytes) -> None:
        self._put(name, [data], overwrite=False)  # If-None-Match: *

    async def _delete(self, name: str) -> None:
        await self._call("delete", name, lambda b: b.delete_blob(**NO_SDK_RETRIES))

    # --- data objects -------------------------------------------------------------------
    def open_sink(self, name: str) -> "BlockSink":
        return BlockSink(self, name)

    async def _get_range(self, name: str, start: int, end: int, into: Sequence[memoryview] | None) -> Any:
        async def download(blob: Any) -> Any:
            stream = await blob.download_blob(offset=start, length=end - start, max_concurrency=1, **NO_SDK_RETRIES)
            if into is None:
                return await stream.readall()
            # readinto hands over each response body whole (the SDK's chunks() re-slices it per 4 MiB)
            return await stream.readinto(BufferFiller(into, self.describe(name)))

        return await self._call(self.read_operation, name, download)


async def content_md5(pieces: Sequence[Any]) -> str:
    """The ``Content-MD5`` of the pieces back to back, hashed in a worker thread (hashlib releases the GIL)."""

    def digest() -> bytes:
        md5 = hashlib.md5(usedforsecurity=False)
        for piece in pieces:
            md5.update(piece)
        return md5.digest()

    return base64.b64encode(await asyncio.to_thread(digest)).decode("ascii")


class BlockSink(PartStream):
    """One blob (``PartStream``): one upload if it stays under 1.25 x ``part_size``, else blocks staged
    in parallel (each with its MD5) and committed as the block list, in order."""

    max_part_bytes = MAX_BLOCK_BYTES

    def __init__(self, store: AzureStore, name: str):
        super().__init__(store, name)
        self.store: AzureStore = store
        self.upload_id = secrets.token_hex(4)
        self.block_ids: list[str] = []

    def next_part_size(self) -> int:
        return min(self.store.part_size, MAX_BLOCK_BYTES)  # part_size may be 4 GiB; a block holds 4000 MiB

    def send_part(self, pieces: list[tuple[memoryview, int | None]]) -> None:
        if len(self.block_ids) == MAX_BLOCKS:
            raise StorageError(
                f"{self.store.describe(self.name)} needs more than Azure's {MAX_BLOCKS} blocks per blob: raise "
                f"part_size (now {self.store.part_size} bytes)"
            )
        # Block ids of one blob must all have the same length; this upload's own prefix keeps a
        # concurrent writer's uncommitted blocks apart.
        block_id = base64.b64encode(f"{self.upload_id}-{len(self.block_ids):06d}".encode()).decode("ascii")
        self.block_ids.append(block_id)

        views = [p for p, _ in pieces]

        def stage(blob: Any, headers: dict) -> Any:
            # sent from the written pieces as they are (a fresh body per attempt), not joined
            body = RequestBody(views)
            return blob.stage_block(block_id, body, length=len(body), headers=headers, **NO_SDK_RETRIES)

        self.submit(self.store._send("stage block", self.name, views, stage))

    def close(self) -> None:
        if not self.parts and self.pending_bytes <= MAX_SINGLE_PUT_BYTES:
            self.store._put(self.name, [p for p, _ in self.take_rest()], overwrite=True)
            return
        if self.pending:
            self.send_last_part(self.take_rest(), "stage block")
        self.results("stage block")
        blocks = list(self.block_ids)
        self.store._run("commit", self.name, lambda b: b.commit_block_list(blocks, **NO_SDK_RETRIES))

    def abort(self) -> None:
        # staged blocks that are never committed are discarded by the service (after a week)
        self.cancel_parts()
