"""Client-side S3 request counting (botocore event hooks, so it works against real S3 too),
resident-memory sampling, and per-rank file accounting of a finished checkpoint."""

from __future__ import annotations

import collections
import re
import resource
import threading
import time

import fsspec

from ckptio.storage.retry import is_throttling_answer

OPERATION_KINDS = {
    "PutObject": "PUT",
    "CreateMultipartUpload": "MPU_CREATE",
    "UploadPart": "MPU_PART",
    "CompleteMultipartUpload": "MPU_COMPLETE",
    "AbortMultipartUpload": "MPU_ABORT",
    "GetObject": "GET",
    "HeadObject": "HEAD",
    "HeadBucket": "HEAD",
    "ListObjectsV2": "LIST",
    "ListObjects": "LIST",
    "CopyObject": "COPY",
    "UploadPartCopy": "COPY",
    "DeleteObject": "DELETE",
    "DeleteObjects": "DELETE",
}
REQUEST_KINDS = (
    "PUT",
    "MPU_CREATE",
    "MPU_PART",
    "MPU_COMPLETE",
    "MPU_ABORT",
    "GET",
    "HEAD",
    "LIST",
    "COPY",
    "DELETE",
    "OTHER",
)

#: Answers that asked the client to slow down (503 SlowDown, 429 and kin), counted apart from the kinds.
THROTTLED = "THROTTLED"

requests: collections.Counter = collections.Counter()
served = [0]  # bytes of GetObject response bodies (what storage served this process)
_lock = threading.Lock()
_installed = False


def _count(event_name: str = "", **_: object) -> None:
    operation = event_name.rsplit(".", 1)[-1]
    with _lock:
        requests[OPERATION_KINDS.get(operation, "OTHER")] += 1


def _count_throttled(http_response=None, parsed: dict | None = None, **_: object) -> None:
    code = ((parsed or {}).get("Error") or {}).get("Code")
    if is_throttling_answer(code, getattr(http_response, "status_code", None)):
        with _lock:
            requests[THROTTLED] += 1


def _count_served(parsed: dict | None = None, **_: object) -> None:
    with _lock:
        served[0] += int((parsed or {}).get("ContentLength") or 0)


def install_s3_counter() -> None:
    """Count every request any s3fs client in this process sends (retries included)."""
    global _installed
    if _installed:
        return
    import s3fs

    original = s3fs.S3FileSystem.set_session

    async def set_session(self, *args, **kwargs):
        client = await original(self, *args, **kwargs)
        _count_on(self._s3)
        return client

    s3fs.S3FileSystem.set_session = set_session
    s3fs.S3FileSystem._connect = set_session
    for fs in list(s3fs.S3FileSystem._cache.values()):  # clients connected before this call
        if getattr(fs, "_s3", None) is not None:
            _count_on(fs._s3)
    _installed = True


def _count_on(client) -> None:
    if not getattr(client, "_ckptio_bench_counted", False):
        client.meta.events.register("before-send.s3", _count)
        client.meta.events.register("after-call.s3.GetObject", _count_served)
        client.meta.events.register("after-call.s3", _count_throttled)
        client._ckptio_bench_counted = True


def take_served_bytes() -> int:
    with _lock:
        n, served[0] = served[0], 0
    return n


def take_counts() -> dict[str, int]:
    with _lock:
        counts = {k: requests.get(k, 0) for k in (*REQUEST_KINDS, THROTTLED)}
        requests.clear()
    return counts


class PeakRSS:
    """Samples this process's resident memory while active; ``peak_delta`` is the growth over the start."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def peak_delta(self) -> int:
        return self.peak - self.start


def rss() -> int:
    """This process's resident memory in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


_RANK_IN_NAME = (re.compile(r"-r(\d+)\.ckio$"), re.compile(r"^__(\d+)_\d+\.distcp$"))


def checkpoint_files(url: str, storage_options: dict | None) -> dict[str, int]:
    """Name -> size of every file or object directly under ``url``."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    fs.invalidate_cache()
    return {str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: int(e["size"]) for e in fs.ls(root, detail=True)}


def remove(url: str, storage_options: dict | None) -> None:
    """Delete a benchmark checkpoint, so a long run does not fill the disk or the S3 server's memory."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    fs.rm(root, recursive=True)


def rank_of(name: str) -> int | None:
    for pattern in _RANK_IN_NAME:
        m = pattern.search(name)
        if m:
            return int(m.group(1))
    return None


def now() -> float:
    return time.perf_counter()


def cpu_seconds() -> float:
    """CPU time of this process so far, all its threads, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bytes_by_dtype(url: str, storage_options: dict | None) -> dict[str, list[int]]:
    """dtype -> [logical, stored] bytes of the tensors in a ckptio or torch DCP checkpoint, from its
    metadata (torch records each item's stored length; ckptio each block's)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    import ckptio

    out: dict[str, list[int]] = {}
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if not fs.exists(f"{root}/.metadata"):  # ckptio's: ckptio.json, or the fragments of a save without a coordinator
        manifest = ckptio.Reader(url, storage_options=storage_options).prefetch_metadata()
        for item in manifest.items.values():
            if item.dtype is not None:
                entry = out.setdefault(item.dtype, [0, 0])
                entry[0] += item.logical_bytes
                entry[1] += item.stored_bytes
        return out
    from ckptio.torch_seam import FsspecReader

    reader = FsspecReader(url, **(storage_options or {}))
    metadata = reader.read_metadata()
    for index, info in metadata.storage_data.items():
        md = metadata.state_dict_metadata[index.fqn]
        if isinstance(md, TensorStorageMetadata):
            chunk = next(c for c in md.chunks if c.offsets == index.offset)
            entry = out.setdefault(str(md.properties.dtype).removeprefix("torch."), [0, 0])
            entry[0] += chunk.sizes.numel() * md.properties.dtype.itemsize
            entry[1] += info.length
    return out
