"""Where a save or load spends its time on one rank, for any DCP writer or reader, and how fast the
target itself writes and reads.

``Timed`` wraps a ``StorageWriter`` or ``StorageReader`` and adds up the seconds this rank spends
inside each of its methods, by phase. torch's collectives run between those calls, so the time a rank
waits for another in a gather or scatter is not in any phase (a reader's ``read_metadata`` that
receives the document from the rank that read it does wait for that rank: ckptio reads it once per
load). ``raw_bandwidth`` writes and fsyncs, then reads back, as many bytes per rank as a save writes,
with plain large system calls: what the disk gives four processes, for a writer to be measured against.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from ckptio.format.codec import checksum

#: method -> phase
SAVE_PHASES = {
    "reset": "plan",
    "set_up_storage_writer": "plan",
    "prepare_local_plan": "plan",
    "prepare_global_plan": "plan",
    "write_data": "write",
    "finish": "finish",
}
LOAD_PHASES = {
    "reset": "metadata",
    "read_metadata": "metadata",
    "set_up_storage_reader": "plan",
    "prepare_local_plan": "plan",
    "prepare_global_plan": "plan",
    "read_data": "read",
}
#: Bytes per system call of the raw measurement (large enough that the disk, not Python, bounds it).
RAW_WRITE_BYTES = 8 << 20


def timed(inner: Any) -> Any:
    """``inner`` (a writer or reader) with its methods timed into ``.phases``."""
    phases = SAVE_PHASES if isinstance(inner, StorageWriter) else LOAD_PHASES
    base = StorageWriter if isinstance(inner, StorageWriter) else StorageReader
    wrapper = type(f"Timed{type(inner).__name__}", (_Timed, base), {})
    return wrapper(inner, phases)


class _Timed:
    def __init__(self, inner: Any, phases: dict[str, str]):
        self._inner, self._phases = inner, phases
        self.phases = dict.fromkeys(phases.values(), 0.0)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        phase = self._phases.get(name)
        if phase is None or not callable(value):
            return value

        @functools.wraps(value)  # torch reads the signature (whether it takes **kwargs)
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                result = value(*args, **kwargs)
                wait = getattr(result, "wait", None)  # write_data and read_data return futures
                if callable(wait):
                    wait()
                return result
            finally:
                self.phases[phase] += time.perf_counter() - start

        return call

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


# StorageWriter and StorageReader declare these abstract: route each to the wrapped object.
for _name in {*SAVE_PHASES, *LOAD_PHASES, "storage_meta"}:
    setattr(_Timed, _name, property(lambda self, name=_name: self.__getattr__(name)))


def raw_bandwidth(folder: str, nbytes: int) -> dict[str, float]:
    """Every rank writes ``nbytes`` to a file of its own in ``folder`` and fsyncs it, then reads it back
    with its pages dropped from the cache, then once more from the cache into memory of the file's size,
    checking each read's CRC32C as it lands (what a checked load from the page cache cannot beat); seconds
    of the slowest rank for each, and the bytes of all."""
    rank = dist.get_rank()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"raw-{rank}")
    block = memoryview(os.urandom(min(RAW_WRITE_BYTES, nbytes)))
    seconds = {}
    dist.barrier()
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, block[: min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds["write"] = time.perf_counter() - start
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read comes from the disk, not the cache
        dist.barrier()
        start = time.perf_counter()
        buffer = bytearray(len(block))
        while os.readv(fd, [buffer]):
            pass
        seconds["read"] = time.perf_counter() - start
        seconds["cached_read"] = _cached_checked_read(fd, nbytes, len(block))
    finally:
        os.close(fd)
        os.remove(path)
    slowest = [None] * dist.get_world_size()
    dist.all_gather_object(slowest, seconds)
    return {
        "bytes": nbytes * len(slowest),
        "write_s": max(s["write"] for s in slowest),
        "read_s": max(s["read"] for s in slowest),
        "cached_read_s": max(s["cached_read"] for s in slowest),
    }


def _cached_checked_read(fd: int, nbytes: int, call_bytes: int) -> float:
    """Seconds to read the (cached) file into memory already touched, a CRC32C over each system call's
    bytes right after it (ckptio's checksum, as a load checks its blocks)."""
    memory = memoryview(np.ones(nbytes, dtype=np.uint8))
    dist.barrier()
    start = time.perf_counter()
    at = 0
    while at < nbytes:
        n = os.preadv(fd, [memory[at : at + call_bytes]], at)
        if n == 0:
            break
        checksum(memory[at : at + n])
        at += n
    return time.perf_counter() - start
