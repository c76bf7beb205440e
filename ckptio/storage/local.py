"""POSIX paths (local disks, NFS): fsync'd data files, rename-based atomic metadata, pread.

Every system call here moves at most ``IOV_MAX`` buffers and ``MAX_SYSCALL_BYTES`` bytes
(``syscall_batch``): Linux refuses a longer scatter list with EINVAL, and some systems refuse
(rather than shorten) a larger transfer. Requests of any size and any number of pieces are
carried by as many calls as these limits need.
"""

from __future__ import annotations

import functools
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from ckptio.config import LOCAL_READ_GAP_BYTES, WRITEBACK_BYTES
from ckptio.errors import StorageError
from ckptio.storage.base import FsspecStore, ReadRequest
from ckptio.storage.writeback import start_writeback

#: Buffers one readv/preadv/writev call takes (POSIX IOV_MAX; Linux's is 1024).
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024
if IOV_MAX <= 0:  # "no limit" or unknown: POSIX's minimum guarantee is 16, Linux's value is safe in practice
    IOV_MAX = 1024
#: Bytes one read/write call moves on Linux (MAX_RW_COUNT); also below INT_MAX, where macOS stops.
MAX_SYSCALL_BYTES = 0x7FFFF000
#: Bytes of requests one reading thread takes at a time (see ``read_into``).
READ_TASK_BYTES = 4 << 20


def syscall_batch(buffers: Sequence[memoryview]) -> list[memoryview]:
    """The leading buffers one system call may carry: at most ``IOV_MAX`` of them and
    ``MAX_SYSCALL_BYTES`` bytes in all (the last one cut short if need be); never empty while
    ``buffers`` holds a non-empty buffer."""
    batch: list[memoryview] = []
    room = MAX_SYSCALL_BYTES
    for buffer in buffers:
        if len(batch) == IOV_MAX or room == 0:
            break
        piece = buffer[:room]
        batch.append(piece)
        room -= len(piece)
    return batch


def _pread_fully(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
    """Fill ``buffers`` from ``offset`` on, in as many preadv calls as the limits and short reads
    need; the bytes read, fewer only at the end of the file."""
    if len(buffers) == 1 and len(buffers[0]) <= MAX_SYSCALL_BYTES:  # the common case: one call
        done = os.preadv(fd, buffers, offset)
        if done in (0, len(buffers[0])):
            return done
    else:
        done = 0
    total = sum(len(b) for b in buffers)
    remaining = _advance([b for b in buffers if len(b)], done)
    while done < total:
        n = os.preadv(fd, syscall_batch(remaining), offset + done)
        if n == 0:
            break
        done += n
        remaining = _advance(remaining, n)
    return done


class LocalStore(FsspecStore):
    read_gap_bytes = LOCAL_READ_GAP_BYTES

    @functools.cached_property
    def remote(self) -> bool:  # type: ignore[override]
        """A path on NFS, Lustre or a FUSE mount is as remote as an object store."""
        return on_network_filesystem(self.root)

    def _tidy_folder_of(self, name: str) -> None:
        """Remove the key-prefix folder ``name`` sat in once it is empty (another file may still be there)."""
        if "/" in name:
            try:
                os.rmdir(os.path.dirname(self.path(name)))
            except OSError:
                pass

    def open_sink(self, name: str) -> "_LocalSink":
        path = self.path(name)
        if "/" in name:  # a data file under its key prefix (WriterConfig.key_prefix)
            self._guard(name, "create", lambda: os.makedirs(os.path.dirname(path), exist_ok=True))
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

    def rename(self, name: str, new_name: str) -> None:
        """Move ``name`` to ``new_name`` atomically and durably (replacing it)."""
        self._guard(new_name, "rename", lambda: os.replace(self.path(name), self.path(new_name)))
        _fsync_dir(self.root)

    def read(self, name: str) -> bytes:
        """Whole file (fsspec's ``cat_file`` costs ~70 us a call in Python: a load that merges thousands
        of fragments reads as many files)."""

        def read_file() -> bytes:
            with open(self.path(name), "rb") as f:
                return f.read()

        return self._guard(name, "read", read_file, passthrough=(FileNotFoundError,))

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

            def fill_all(group: Sequence[ReadRequest]) -> list[int]:
                return [
                    self._guard(r.name, "read", lambda r=r: _pread_fully(fds[r.name], r.buffers, r.offset))
                    for r in group
                ]

            # A task per pread costs more in scheduling than a small read itself (thousands of them
            # for a column shard, one per row): requests go to the threads in groups of at least
            # READ_TASK_BYTES, so small reads share few threads and large ones still spread.
            groups: list[list[ReadRequest]] = [[]]
            size = 0
            for request in requests:
                if groups[-1] and size >= READ_TASK_BYTES:
                    groups.append([])
                    size = 0
                groups[-1].append(request)
                size += sum(len(b) for b in request.buffers)
            workers = max(1, min(len(groups), self.config.max_concurrency))
            if workers == 1:  # one group (a decoding thread reading its own blocks), or one thread allowed
                return [count for group in groups for count in fill_all(group)]
            with ThreadPoolExecutor(workers) as pool:
                return [count for counts in pool.map(fill_all, groups) for count in counts]
        finally:
            for fd in fds.values():
                os.close(fd)

    def read_runs(self, name: str, offsets: Sequence[int], run_bytes: int, out: memoryview) -> int:
        """Read ``run_bytes`` at each of ``offsets`` of one file into consecutive parts of ``out``, a
        pread each in one tight loop (a column shard is one run per row: thousands of small reads,
        for which a request object and a thread task each would cost more than the read); returns
        the bytes read, fewer only when the file is shorter. ``run_bytes`` <= ``MAX_SYSCALL_BYTES``."""
        fd = self._open_regular(name)

        def read_all() -> int:
            done = 0
            for k, offset in enumerate(offsets):
                got = _pread_fully(fd, (out[k * run_bytes : (k + 1) * run_bytes],), offset)
                done += got
                if got < run_bytes:
                    break
            return done

        try:
            return self._guard(name, "read", read_all)
        finally:
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
    """The buffers still to fill after ``n`` more bytes were read into them (and no empty ones)."""
    done = 0
    while done < len(buffers) and (n >= len(buffers[done])):
        n -= len(buffers[done])
        done += 1
    rest = buffers[done:]  # one slice, not a pop(0) per buffer: a request may carry thousands
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


class _LocalSink:
    def __init__(self, store: LocalStore, name: str, handle):
        self.store, self.name, self.handle = store, name, handle
        self.written = self.flushed = 0  # bytes written, and those whose writeback was started

    def write(self, data: bytes | memoryview, crc: int | None = None) -> None:
        view = memoryview(data).cast("B")
        while view:
            piece = view[:MAX_SYSCALL_BYTES]
            written = self.store._guard(self.name, "write", lambda piece=piece: self.handle.write(piece))
            view = view[written:]
            self.written += written
        if self.written - self.flushed >= WRITEBACK_BYTES:
            start_writeback(self.handle.fileno(), self.flushed, self.written - self.flushed)
            self.flushed = self.written

    def close(self) -> None:
        def finish() -> None:
            os.fsync(self.handle.fileno())
            self.handle.close()
            _fsync_dir(os.path.dirname(self.store.path(self.name)))
            if "/" in self.name:  # and the key prefix's folder in the root
                _fsync_dir(self.store.root)

        self.store._guard(self.name, "finish", finish)

    def abort(self) -> None:
        try:
            self.handle.close()
        finally:
            self.store.delete_best_effort([self.name])


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_NETWORK_FILESYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "beegfs", "ceph", "glusterfs", "9p")


def on_network_filesystem(path: str) -> bool:
    """Whether a local path lies on a network filesystem (NFS, Lustre, ...; ``/proc/mounts``)."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return False
    path = os.path.realpath(path)
    best, kind = "", ""
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fstype
    return kind in _NETWORK_FILESYSTEMS or kind.startswith("fuse.")
