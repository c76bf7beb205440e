"""POSIX paths (local disks, NFS): fsync'd data files, rename-based atomic metadata, pread."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from .base import FsspecStore, RangeRequest, ReadInto


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
        buffers = [bytearray(end - start) for _, start, end in requests]
        counts = self.read_into([ReadInto(n, s, memoryview(b)) for (n, s, _), b in zip(requests, buffers)])
        return [bytes(memoryview(b)[:c]) if c < len(b) else b for b, c in zip(buffers, counts)]

    def read_into(self, reads: Sequence[ReadInto]) -> list[int]:
        if not reads:
            return []
        workers = max(1, min(len(reads), getattr(self.config, "max_concurrency", 4)))
        fds: dict[str, int] = {}
        try:
            for read in reads:
                if read.name not in fds:
                    fds[read.name] = self._guard(
                        read.name,
                        "open",
                        lambda n=read.name: os.open(self.path(n), os.O_RDONLY),
                        passthrough=(FileNotFoundError,),
                    )

            def fill(read: ReadInto) -> int:
                done = 0
                while done < len(read.buffer):
                    n = os.preadv(fds[read.name], [read.buffer[done:]], read.offset + done)
                    if n == 0:
                        break
                    done += n
                return done

            with ThreadPoolExecutor(workers) as pool:
                return list(pool.map(lambda r: self._guard(r.name, "read", lambda: fill(r)), reads))
        finally:
            for fd in fds.values():
                os.close(fd)


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
