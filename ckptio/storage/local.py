"""POSIX paths (local disks, NFS): fsync'd data files, rename-based atomic metadata, pread."""

from __future__ import annotations

import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from ..errors import StorageError
from .base import FsspecStore, ReadRequest


class LocalStore(FsspecStore):
    def open_sink(self, name: str) -> "_LocalSink":
        path = self.path(name)
        handle = self._guard(name, "open", lambda: open(path, "wb", buffering=0))
        return _LocalSink(self, name, handle)

    def put_atomic(self, name: str, data: bytes) -> None:
        self._publish(name, data, os.replace)

    def put_if_absent(self, name: str, data: bytes) -> None:
        """Exclusive publish: a hard link fails if the name exists, so two writers cannot both win."""
        self._publish(name, data, os.link)

    def _publish(self, name: str, data: bytes, place) -> None:
        """Write ``data`` durably to a temporary file, then ``place(temporary, final)`` it."""
        final = self.path(name)
        tmp = f"{final}.tmp-{os.getpid()}-{threading.get_ident()}"

        def publish() -> None:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            place(tmp, final)
            _fsync_dir(self.root)

        try:
            self._guard(name, "write", publish, passthrough=(FileExistsError,))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def size(self, name: str) -> int:
        fd = self._open_regular(name)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def read_into(self, requests: Sequence[ReadRequest]) -> list[int]:
        if not requests:
            return []
        fds: dict[str, int] = {}
        try:
            for request in requests:
                if request.name not in fds:
                    fds[request.name] = self._open_regular(request.name)

            def fill(request: ReadRequest) -> int:
                done, total = 0, request.length
                buffers = list(request.buffers)
                while done < total:
                    n = os.preadv(fds[request.name], buffers, request.offset + done)
                    if n == 0:
                        break
                    done += n
                    buffers = _advance(buffers, n)
                return done

            workers = max(1, min(len(requests), self.config.max_concurrency))
            with ThreadPoolExecutor(workers) as pool:
                return list(pool.map(lambda r: self._guard(r.name, "read", lambda: fill(r)), requests))
        finally:
            for fd in fds.values():
                os.close(fd)

    def _open_regular(self, name: str) -> int:
        """Open for reading without blocking (a FIFO would hang a plain open or read) and refuse
        anything that is not a regular file. Raises ``FileNotFoundError`` when it is absent."""
        path = self.path(name)
        fd = self._guard(
            name, "open", lambda: os.open(path, os.O_RDONLY | os.O_NONBLOCK), passthrough=(FileNotFoundError,)
        )
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StorageError(
                f"{self.describe(name)} is not a regular file; a checkpoint's data files are plain files. "
                "Replace it with the real file or load an earlier checkpoint"
            )
        return fd


def _advance(buffers: list[memoryview], n: int) -> list[memoryview]:
    """The buffers still to fill after ``n`` more bytes were read into them."""
    while n and buffers:
        if n >= len(buffers[0]):
            n -= len(buffers[0])
            buffers.pop(0)
        else:
            buffers[0] = buffers[0][n:]
            n = 0
    return buffers


class _LocalSink:
    def __init__(self, store: LocalStore, name: str, handle):
        self.store, self.name, self.handle = store, name, handle

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            written = self.store._guard(self.name, "write", lambda v=view: self.handle.write(v))
            view = view[written:]

    def close(self) -> None:
        def finish() -> None:
            os.fsync(self.handle.fileno())
            self.handle.close()
            _fsync_dir(self.store.root)

        self.store._guard(self.name, "finish", finish)

    def abort(self) -> None:
        try:
            self.handle.close()
        finally:
            self.store.delete([self.name])


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
