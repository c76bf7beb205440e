"""Google Cloud Storage: ckptio's requests over the JSON API, through gcsfs's HTTP session and credentials
(``storage_options`` keep gcsfs's meaning: ``token``, ``project``, ``endpoint_url``; without them,
Application Default Credentials), every request retried by ckptio's one policy (gcsfs's own retries
are not used). The commit is a create-only upload (``ifGenerationMatch=0``); small objects go up as one
multipart upload carrying their CRC32C, which GCS checks (and ckptio checks the CRC32C it answers with:
an emulator may not); data objects go up as parts in parallel, each its own object, then composed into
the final object (GCS's parallel composite upload: 32 sources per compose) and the parts deleted."""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
from typing import Any, Awaitable, Callable, Sequence
from urllib.parse import quote

import fsspec

from ckptio.errors import StorageError
from ckptio.format.codec import checksum_concat, checksum_of_pieces
from ckptio.storage.object_store import ObjectStore, PartStream, PreconditionFailed, aiohttp_chunks, read_chunks_into
from ckptio.storage.request_body import RequestBody
from ckptio.storage.retry import StoreAnswer, store_answer

log = logging.getLogger(__name__)

#: Sources one compose request may name (GCS's limit).
MAX_COMPOSE_SOURCES = 32
#: A data object's parts are objects beside it named ``<name>.ckptio-part.<upload id>.<number>``
#: until they are composed; a save that died leaves them, and ``open_uploads`` finds them.
PART_MARK = ".ckptio-part."
#: Objects of at most this many parts (160 MiB at the default part_size; gcloud storage's threshold is
#: 150 MiB) go up as one upload: a composed upload costs 2 requests more per part, and each part is an
#: object whose deletion a bucket with soft delete (on by default, 7 days) still bills for its
#: retention. Above it, parallel parts pay for themselves. Until then the written blocks wait for close
#: (views of the staged tensors; compressed blocks: up to 160 MiB more per file being written).
COMPOSE_ABOVE_PARTS = 5


def gcs_filesystem(storage_options: dict[str, Any] | None) -> fsspec.AbstractFileSystem:
    """gcsfs's core filesystem for the user's options. Not the one fsspec's registry may pick: gcsfs
    2026.10 probes every new bucket for zonal/hierarchical namespaces, 60 s against an emulator,
    unless ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``; ckptio uses no such bucket feature."""
    try:
        import gcsfs
    except ImportError as exc:
        raise StorageError("gs:// needs gcsfs, which is not installed: pip install 'ckptio[gcs]'") from exc
    options = dict(storage_options or {})
    if "endpoint_url" not in options and os.environ.get("STORAGE_EMULATOR_HOST"):
        options["endpoint_url"] = os.environ["STORAGE_EMULATOR_HOST"]
    if options.get("endpoint_url") and "token" not in options and not options["endpoint_url"].startswith("https"):
        options["token"] = "anon"  # an emulator on plain HTTP asks no credentials
    return gcsfs.GCSFileSystem(**options)


def crc32c_value(crc: int) -> str:
    """GCS's spelling of a CRC32C: base64 of its 4 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


class GCSStore(ObjectStore):
    read_operation = "get"
    read_operations = ("get",)
    precondition = "ifGenerationMatch=0"

    async def _session(self) -> Any:
        await self.fs._set_session()
        return self.fs.session

    async def endpoint(self) -> str:
        return str(self.fs._location)

    def _object_url(self, name: str, upload: bool = False) -> str:
        base = f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"
        if upload:
            return base
        return f"{self.fs._location}/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(self.key(name), safe='')}"

    async def _call(
        self,
        method: str,
        name: str,
        url: str,
        *,
        reported_as: str | None = None,
        check: Callable[[Any], Awaitable[None]] | None = None,
        **request: Any,
    ) -> Any:
        """``_once``, retried. ``check(answer)`` runs within each attempt (its error retries it)."""

        async def attempt() -> Any:
            answer = await self._once(method, name, url, **request)
            if check is not None:
                await check(answer)
            return answer

        return await self.retried(reported_as or method, name, attempt)

    async def _once(
        self,
        method: str,
        name: str,
        url: str,
        *,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        body: Sequence[Any] | None = None,
        into: Sequence[memoryview] | None = None,
    ) -> Any:
        """One request; its body as bytes, parsed JSON (``application/json``), or the count of bytes copied
        into ``into``."""
        session = await self._session()
        data = RequestBody(body) if body is not None else None  # a fresh one per attempt
        async with session.request(
            method, url, params=params, headers=self.fs._get_headers(headers), data=data
        ) as response:
            if response.status >= 400:
                raise _answer(response.status, await response.read(), method, self.describe(name))
            if into is not None:
                return await read_chunks_into(aiohttp_chunks(response.content), into, self.describe(name))
            content = await response.read()
            media = (params or {}).get("alt") == "media"  # an object's bytes, whatever its content type says
            if response.content_type == "application/json" and content and not media:
                return json.loads(content)
            return content

    def _run(self, operation: str, name: str, method: str, url: str, **kwargs: Any) -> Any:
        return self._sync(operation, name, self._call, method, name, url, reported_as=operation, **kwargs)

    def _translate(self, exc: BaseException, operation: str, name: str) -> BaseException:
        if isinstance(exc, (StorageError, FileNotFoundError, PreconditionFailed)):
            return exc
        code, status = store_answer(exc) or ("", None)
        if status == 404:
            # an upload's 404 can only be the bucket's; another request's says so
            if operation in ("upload", "compose") or "bucket" in str(exc).lower():
                return self.missing_bucket(operation, name)
            return FileNotFoundError(self.describe(name))
        if status == 412:
            return PreconditionFailed(self.describe(name))
        if status in (401, 403):
            return self.access_denied(
                operation,
                name,
                (code, status),
                "storage_options token=..., or Application Default Credentials: GOOGLE_APPLICATION_CREDENTIALS, "
                "gcloud auth application-default login",
            )
        return self.failed_after_retries(operation, name, exc)

    # --- small objects ------------------------------------------------------------------
    def _metadata(self, name: str) -> dict:
        return self._run("get", name, "GET", self._object_url(name))

    def size(self, name: str) -> int:
        return int(self._metadata(name)["size"])

    def read(self, name: str) -> bytes:
        return self._run("get", name, "GET", self._object_url(name), params={"alt": "media"})

    async def _upload(
        self, name: str, key: str, pieces: Sequence[tuple[Any, int | None]], if_absent: bool = False
    ) -> dict:
        """One multipart upload of ``pieces`` as object ``key``, declaring their CRC32C; ``if_absent``:
        only where no object ``key`` exists (``ifGenerationMatch=0``)."""
        crc = crc32c_value(checksum_of_pieces(pieces))
        boundary = secrets.token_hex(16)
        head = (
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
            f"{json.dumps({'name': key, 'crc32c': crc, 'contentType': 'application/octet-stream'})}\r\n"
            f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n"
        ).encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        params = {"uploadType": "multipart"}
        if if_absent:
            params["ifGenerationMatch"] = "0"

        async def check(answer: Any) -> None:
            try:
                _check_crc32c(answer, crc, self.describe(name))
            except StoreAnswer:
                if if_absent:  # this attempt created it, damaged: remove that generation, so the retry may create it
                    generation = {"ifGenerationMatch": str(answer["generation"])}
                    await self._once("DELETE", name, self._object_url(name), params=generation)
                raise

        return await self._call(
            "POST",
            name,
            self._object_url(name, upload=True),
            params=params,
            headers={"Content-Type": f"multipart/related; boundary={boundary}"},
            body=[head, *(data for data, _ in pieces), tail],
            reported_as="upload",
            check=check,
        )

    def put_atomic(self, name: str, data: bytes) -> None:
        self._sync("upload", name, self._upload, name, self.key(name), [(data, None)])

    def _create_only(self, name: str, data: bytes) -> None:
        self._sync("upload", name, self._upload, name, self.key(name), [(data, None)], True)  # ifGenerationMatch=0

    async def _delete(self, name: str) -> None:
        await self._call("DELETE", name, self._object_url(name), reported_as="delete")

    def open_uploads(self) -> list[tuple[str, str]]:
        """Parts a save left uncomposed, one entry per data object and upload id."""
        found = set()
        for name in self.list_names(nested=True) or []:
            target, mark, rest = name.partition(PART_MARK)
            if mark:
                found.add((target, rest.partition(".")[0]))
        return sorted(found)

    def abort_upload(self, name: str, upload_id: str) -> None:
        prefix = f"{name}{PART_MARK}{upload_id}."
        for part in [n for n in self.list_names(nested=True) or [] if n.startswith(prefix)]:
            self.remove(part)

    # --- data objects -------------------------------------------------------------------
    def open_sink(self, name: str) -> "ComposeSink":
        return ComposeSink(self, name)

    async def _get_range(self, name: str, start: int, end: int, into: Sequence[memoryview] | None) -> Any:
        return await self._call(
            "GET",
            name,
            self._object_url(name),
            params={"alt": "media"},
            headers={"Range": f"bytes={start}-{end - 1}"},
            into=into,
            reported_as=self.read_operation,
        )

    async def _compose(self, name: str, key: str, sources: list[str], crc: int, size: int) -> None:
        url = f"{self.fs._location}/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(key, safe='')}/compose"
        request = {
            "sourceObjects": [{"name": source} for source in sources],
            "destination": {"contentType": "application/octet-stream"},
        }

        async def check(answer: Any) -> None:
            if int(answer.get("size", -1)) != size:
                raise StorageError(f"compose {self.describe(name)}: {answer.get('size')} bytes, expected {size}")
            _check_crc32c(answer, crc32c_value(crc), self.describe(name))

        await self._call(
            "POST",
            name,
            url,
            headers={"Content-Type": "application/json"},
            body=[json.dumps(request).encode()],
            reported_as="compose",
            check=check,
        )


def _answer(status: int, content: bytes, method: str, where: str) -> StoreAnswer:
    """An error answer of the JSON API as a ``StoreAnswer`` (code: the first error's reason)."""
    try:
        error = json.loads(content)["error"]
        reason = (error.get("errors") or [{}])[0].get("reason") or str(status)
        message = error.get("message") or ""
    except (ValueError, KeyError, TypeError, AttributeError):
        reason, message = str(status), content[:200].decode("utf-8", "replace")
    return StoreAnswer(f"{method} {where}: HTTP {status} {reason}: {message}", reason, status)


def _check_crc32c(answer: Any, sent: str, where: str) -> None:
    """The store's CRC32C of what it stored must be the one sent: else the bytes changed in flight
    (``BadDigest``: retried). GCS itself refuses such an upload; an emulator may not check."""
    stored = answer.get("crc32c") if isinstance(answer, dict) else None
    if stored is not None and stored != sent:
        raise StoreAnswer(f"{where}: the store holds CRC32C {stored}, ckptio sent {sent}", "BadDigest", 400)


class ComposeSink(PartStream):
    """One GCS data object (``PartStream``): one upload if it stays within ``COMPOSE_ABOVE_PARTS`` parts;
    else parts uploaded in parallel as objects of their own, composed (32 at a time, in rounds) into the
    object, then deleted. Each upload carries its CRC32C; the composed object's CRC32C and size are
    checked against those of the parts."""

    single_upload_parts = COMPOSE_ABOVE_PARTS

    def __init__(self, store: GCSStore, name: str):
        super().__init__(store, name)
        self.store: GCSStore = store
        self.upload_id = secrets.token_hex(4)
        self.part_crcs: list[tuple[int, int]] = []  # (CRC32C, size) per part, in order

    def _part_key(self, label: str) -> str:
        return self.store.key(f"{self.name}{PART_MARK}{self.upload_id}.{label}")

    def send_part(self, pieces: list[tuple[memoryview, int | None]]) -> None:
        self.part_crcs.append((checksum_of_pieces(pieces), sum(len(p) for p, _ in pieces)))
        key = self._part_key(f"{len(self.parts) + 1:05d}")
        self.submit(self.store._upload(self.name, key, pieces))

    def close(self) -> None:
        if not self.parts:
            self.store._sync(
                "upload", self.name, self.store._upload, self.name, self.store.key(self.name), self.take_rest()
            )
            return
        if self.pending:
            self.send_last_part(self.take_rest(), "upload")
        self.results("upload")
        sources = [(self._part_key(f"{n:05d}"), crc, size) for n, (crc, size) in enumerate(self.part_crcs, 1)]
        made: list[str] = []
        try:
            level = 0
            while len(sources) > MAX_COMPOSE_SOURCES:
                level += 1
                groups = [sources[i : i + MAX_COMPOSE_SOURCES] for i in range(0, len(sources), MAX_COMPOSE_SOURCES)]
                sources = [self._compose_group(self._part_key(f"c{level}.{i:05d}"), g) for i, g in enumerate(groups)]
                made += [key for key, _, _ in sources]
            self._compose_group(self.store.key(self.name), sources)
        finally:
            self._delete_parts(made)

    def _compose_group(self, key: str, sources: list[tuple[str, int, int]]) -> tuple[str, int, int]:
        crc, size = 0, 0
        for _, part_crc, part_size in sources:
            crc, size = checksum_concat(crc, part_crc, part_size), size + part_size
        self.store._sync(
            "compose", self.name, self.store._compose, self.name, key, [k for k, _, _ in sources], crc, size
        )
        return key, crc, size

    def _delete_parts(self, composed: list[str]) -> None:
        keys = [self._part_key(f"{n:05d}") for n in range(1, len(self.parts) + 1)] + composed
        prefix = self.store.key("")
        self.store.delete_best_effort([key[len(prefix) :] for key in keys])

    def abort(self) -> None:
        self.cancel_parts()
        if self.parts:
            self._delete_parts([])
