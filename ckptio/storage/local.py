"""POSIX paths (local disks, NFS): fsync'd data files, rename-based atomic metadata, pread."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from .base import FsspecStore, RangeRequest


class LocalStore(FsspecStore):
    def open_sink(self, name: str) -> "_LocalSink":
        path = self.path(name)
        handle = self._guard(name, "open", lambda: open(path, "wb", buffering=0))
        return _LocalSink(self, name, handle)

    def put_atomic(self, name: str, data: bytes) -> None:
        final = self.path(name)
        tmp = f"{final}.tmp-{os.getpid()}"

        def publish() -> None:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.root)

        try:
            self._guard(name, "write", publish)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def read_ranges(self, requests: Sequence[RangeRequest]) -> list[bytes]:
        if not requests:
            return []
        workers = max(1, min(len(requests), getattr(self.config, "max_concurrency", 4)))
        fds: dict[str, int] = {}
        try:
            for name, _, _ in requests:
                if name not in fds:
                    fds[name] = self._guard(name, "open", lambda n=name: os.open(self.path(n), os.O_RDONLY))

            def read_one(req: RangeRequest) -> bytes:
                name, start, end = req
                return self._guard(name, "read", lambda: os.pread(fds[name], end - start, start))

            with ThreadPoolExecutor(workers) as pool:
                return list(pool.map(read_one, requests))
        finally:
            for fd in fds.values():
                os.close(fd)


class _LocalSink:
    def __init__(self, store: LocalStore, name: str, handle):
        self.store, self.name, self.handle = store, name, handle

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            written = self.store._guard(self.name, "write", lambda: self.handle.write(view))
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
