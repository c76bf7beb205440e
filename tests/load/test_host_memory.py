"""Load buffers come in ordinary pages: memory advised for huge pages can cost a synchronous
compaction on every fault (see ckptio.loading.host_memory)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ckptio.loading.host_memory import empty_bytes

SIZE = 64 << 20


def _advised_huge(array: np.ndarray) -> bool:
    """Whether the mapping holding the middle of ``array`` carries the huge-page advice (``hg`` in its
    VmFlags; numpy advises from the first page boundary on, so the first page may lie apart)."""
    address = array.__array_interface__["data"][0] + array.nbytes // 2
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds address {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_load_buffers_are_not_advised_for_huge_pages():
    control = np.empty(SIZE, dtype=np.uint8)
    if not _advised_huge(control):
        pytest.skip("this numpy/kernel gives np.empty no huge-page advice to compare with")
    buffer = empty_bytes(SIZE)
    assert buffer.dtype == np.uint8 and buffer.shape == (SIZE,)
    assert not _advised_huge(buffer)
