"""Uninitialized host memory for the transient buffers of a load (reads, decodes, exchanges)."""

from __future__ import annotations

import numpy as np
import torch


def empty_bytes(n: int) -> np.ndarray:
    """``n`` uninitialized bytes, a numpy ``uint8`` array over memory from torch's allocator.

    Not ``np.empty``: numpy advises the kernel to back arrays of 4 MiB and more with transparent
    huge pages, and where the kernel's THP ``defrag`` setting is ``madvise`` (a common default) a
    page fault in such memory compacts memory synchronously whenever no huge page is free. On a
    machine short of free huge pages that doubled the CPU of a shared-read S3 load (the bench's 2x2
    load on moto: 9.6-13.4 CPU-s/GiB with the advice, 5.7 without). torch asks for ordinary pages."""
    return torch.empty(n, dtype=torch.uint8).numpy()
