"""S3 specifics: data objects streamed as parallel multipart uploads under their final key
(no temp objects, no rename), single PUTs for small objects, parallel ranged GETs, and
every request retried by ``retry.with_retries``. Requests go through s3fs's aiobotocore client,
configured so botocore does not retry on its own: one policy, one place."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Sequence

import fsspec

from ckptio.config import StorageConfig
from ckptio.errors import StorageError
from ckptio.storage import s3_checksums
from ckptio.storage.object_store import ObjectStore, PartStream, PreconditionFailed, read_chunks_into
from ckptio.storage.request_body import RequestBody
from ckptio.storage.retry import store_answer
from ckptio.storage.s3_checksums import EndpointChecksums, crc32c_header

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
    """The user's options, with botocore's own retries and request checksums off unless the user
    configured them: ckptio retries (``retry.py``) and sends each upload's CRC32C itself
    (``s3_checksums.py``); botocore's default CRC32 would be a second pass over every byte, sent as a
    trailer over TLS, which some stores (radosgw 16) refuse."""
    from botocore.config import Config

    options = dict(storage_options or {})
    config = dict(options.get("config_kwargs") or {})
    # total_max_attempts counts the first attempt; botocore's max_attempts counts retries only
    # (max_attempts=1 is one retry of every 503, out of sight of ckptio's policy and its throttle)
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    if "request_checksum_calculation" in Config.OPTION_DEFAULTS:  # botocore >= 1.36
        config.setdefault("request_checksum_calculation", "when_required")
    options["config_kwargs"] = config
    return options


class S3Store(ObjectStore):
    read_operation = "get_object"
    read_operations = ("get_object", "head_object")

    def check_conditional_writes(self) -> None:
        """S3 answers a conditional PUT it does not implement with 501, which ``put_if_absent`` handles (one
        warning, then check-then-write); no probe (its requests are counted per save)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str, config: StorageConfig):
        super().__init__(fs, root, url, config)
        self._unsigned: fsspec.AbstractFileSystem | None = None
        self._endpoint: EndpointChecksums | None = None

    # --- the request primitive ----------------------------------------------------------
    async def _client(self, fs: fsspec.AbstractFileSystem | None = None) -> Any:
        """The aiobotocore client behind s3fs: its private ``_s3`` (set by ``set_session``), ckptio's one use
        of s3fs's privates, checked on the s3fs releases ``pyproject.toml`` admits; every S3 test fails
        here if a release moves it."""
        fs = fs or self.fs
        if fs._s3 is None:
            await fs.set_session()
        return fs._s3

    async def _request(
        self,
        operation: str,
        name: str,
        *,
        body: Sequence[Any] | None = None,
        unsigned: bool = False,
        into: Sequence[memoryview] | None = None,
        **params: Any,
    ) -> Any:
        """One S3 call, retried. ``body``: the pieces of the request body, sent without joining them;
        ``unsigned``: through the client that does not SHA-256 the payload (``s3_checksums``);
        ``into``: a GET's buffers, filled as the body arrives (the byte count is returned)."""
        client = await self._client(self._unsigned_fs() if unsigned else None)

        async def attempt() -> Any:
            if body is not None:
                params["Body"] = RequestBody(body)  # a fresh one per attempt
            response = await getattr(client, operation)(Bucket=self.bucket, **params)
            if operation == "get_object":
                async with response["Body"] as body_stream:
                    if into is not None:
                        return await read_chunks_into(_body_chunks(body_stream), into, self.describe(name))
                    return await body_stream.read()
            return response

        return await self.retried(operation, name, attempt)

    async def endpoint(self) -> str:
        client = await self._client()
        return str(client.meta.endpoint_url or "")

    def _run(self, operation: str, name: str, **params: Any) -> Any:
        return self._sync(operation, name, self._request, operation, name, **params)

    def _unsigned_fs(self) -> fsspec.AbstractFileSystem:
        """The same filesystem with payload signing off (the user's own setting, if any, stands)."""
        if self._unsigned is None:
            options = dict(self.fs.storage_options)
            config = dict(options.get("config_kwargs") or {})
            s3_config = dict(config.get("s3") or {})
            if "payload_signing_enabled" in s3_config:
                self._unsigned = self.fs
            else:
                config["s3"] = {**s3_config, "payload_signing_enabled": False}
                self._unsigned = type(self.fs)(**{**options, "config_kwargs": config})
        return self._unsigned

    async def _checksums(self) -> EndpointChecksums:
        if self._endpoint is None:
            client = await self._client()
            self._endpoint = s3_checksums.for_endpoint(str(client.meta.endpoint_url or ""))
        return self._endpoint

    async def _upload(
        self, operation: str, name: str, pieces: Sequence[tuple[Any, int | None]] | None = None, **params: Any
    ) -> tuple[dict, str | None]:
        """PUT or UploadPart ``pieces`` (``(data, its CRC32C or None)``) with their CRC32C, or
        CreateMultipartUpload declaring CRC32C (no ``pieces``), as ``s3_checksums`` says; returns the
        answer and the CRC32C header sent (``None`` where none was: no body, or a store that refuses them)."""
        endpoint = await self._checksums()
        body = None if pieces is None else [data for data, _ in pieces]
        if endpoint.send_crc32c:
            crc = crc32c_header(pieces) if pieces is not None else None
            checksum = {"ChecksumCRC32C": crc} if crc is not None else {"ChecksumAlgorithm": "CRC32C"}
            unsigned = pieces is not None and endpoint.unsigned_payload
            try:
                response = await self._request(operation, name, body=body, unsigned=unsigned, **checksum, **params)
                endpoint.observe(response, crc)
                return response, crc
            except Exception as exc:
                refusal = endpoint.refusal(exc)
                if refusal is None:
                    raise
            response = await self._request(operation, name, body=body, **params)
            endpoint.refused_by(refusal)
            return response, None
        return await self._request(operation, name, body=body, **params), None

    def _run_upload(
        self, operation: str, name: str, pieces: Sequence[tuple[Any, int | None]] | None = None, **params: Any
    ) -> dict:
        return self._sync(operation, name, self._upload, operation, name, pieces, Key=self.key(name), **params)[0]

    def _translate(self, exc: BaseException, operation: str, name: str) -> BaseException:
        if isinstance(exc, StorageError):
            return exc
        code, status = store_answer(exc) or ("", None)
        if code in ("NoSuchKey", "404", "NotFound"):
            return FileNotFoundError(self.describe(name))
        if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
            return PreconditionFailed(self.describe(name))
        if code == "NoSuchBucket":
            return self.missing_bucket(operation, name)
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return self.access_denied(
                operation,
                name,
                (code, status),
                "storage_options key and secret, or the AWS environment; the region; the bucket policy",
            )
        return self.failed_after_retries(operation, name, exc)

    # --- small objects ------------------------------------------------------------------
    def read(self, name: str) -> bytes:
        return self._run("get_object", name, Key=self.key(name))

    def size(self, name: str) -> int:
        return int(self._run("head_object", name, Key=self.key(name))["ContentLength"])

    def put_atomic(self, name: str, data: bytes) -> None:
        self._run_upload("put_object", name, [(data, None)])

    def _create_only(self, name: str, data: bytes) -> None:
        self._run_upload("put_object", name, [(data, None)], IfNoneMatch="*")

    def open_uploads(self) -> list[tuple[str, str]]:
        prefix = self.key("")
        found: list[tuple[str, str]] = []
        params: dict[str, Any] = {"Prefix": prefix}
        while True:
            page = self._run("list_multipart_uploads", "", **params)
            for upload in page.get("Uploads", []):
                name = upload["Key"][len(prefix) :]
                if name.count("/") <= 1:  # this checkpoint's (a data file may be under its key prefix)
                    found.append((name, upload["UploadId"]))
            if not page.get("IsTruncated"):
                return found
            params.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])

    def abort_upload(self, name: str, upload_id: str) -> None:
        self._run("abort_multipart_upload", name, Key=self.key(name), UploadId=upload_id)

    async def _delete(self, name: str) -> None:
        await self._request("delete_object", name, Key=self.key(name))

    # --- data objects -------------------------------------------------------------------
    def open_sink(self, name: str) -> "MultipartSink":
        return MultipartSink(self, name)

    async def _get_range(self, name: str, start: int, end: int, into: Sequence[memoryview] | None) -> Any:
        return await self._request("get_object", name, into=into, Key=self.key(name), Range=f"bytes={start}-{end - 1}")


async def _body_chunks(stream: Any) -> AsyncIterator[memoryview]:
    content = getattr(getattr(stream, "raw_stream", None), "content", None)  # aiohttp's StreamReader
    if content is None:  # another HTTP backend: the body whole
        yield memoryview(await stream.read())
        return
    while chunk := await content.readany():
        yield memoryview(chunk)


class MultipartSink(PartStream):
    """Streams one S3 object (``PartStream``): a single PUT if it stays under 1.25 x ``part_size``,
    otherwise a multipart upload. Part sizes grow with the part count (``part_size_for``) to stay
    within S3's limits; each part's CRC32C is combined from the pieces' own (only a split piece is
    read for it)."""

    max_part_bytes = MAX_PART_BYTES

    def __init__(self, store: S3Store, name: str):
        super().__init__(store, name)
        self.store: S3Store = store
        self.key = store.key(name)
        self.upload_id: str | None = None

    def next_part_size(self) -> int:
        return part_size_for(len(self.parts) + 1, self.store.part_size)

    def send_part(self, pieces: list[tuple[memoryview, int | None]]) -> None:
        if self.upload_id is None:
            self.upload_id = self.store._run_upload("create_multipart_upload", self.name)["UploadId"]
        number = len(self.parts) + 1
        if number > MAX_PARTS:
            raise StorageError(
                f"{self.store.describe(self.name)} needs more than S3's {MAX_PARTS} parts per upload: "
                f"raise part_size (now {self.store.part_size} bytes) so that parts can hold this rank's data"
            )
        self.submit(
            self.store._upload(
                "upload_part", self.name, pieces, Key=self.key, UploadId=self.upload_id, PartNumber=number
            )
        )

    def close(self) -> None:
        if self.upload_id is None:
            self.store._run_upload("put_object", self.name, self.take_rest())
            return
        if self.pending:
            self.send_last_part(self.take_rest(), "upload_part")
        answers = self.results("upload_part")
        parts = [{"ETag": response["ETag"], "PartNumber": n} for n, (response, _) in enumerate(answers, 1)]
        if all(crc is not None for _, crc in answers):  # all or none: a store that refused some takes none
            for part, (_, crc) in zip(parts, answers, strict=True):
                part["ChecksumCRC32C"] = crc
        self.store._run(
            "complete_multipart_upload",
            self.name,
            Key=self.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": parts},
        )

    def abort(self) -> None:
        self.cancel_parts()
        if self.upload_id is not None:
            try:
                self.store._run("abort_multipart_upload", self.name, Key=self.key, UploadId=self.upload_id)
            except Exception:  # noqa: BLE001 - best effort; the original error matters more
                pass
