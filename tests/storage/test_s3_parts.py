"""S3 multipart part sizes (``ckptio.storage.s3``) within S3's limits."""

from __future__ import annotations

import pytest

from ckptio import StorageConfig, WriterConfig
from ckptio.config import MiB


def test_s3_part_sizes_stay_within_the_part_count_and_size_limits():
    from ckptio.storage.s3 import MAX_PART_BYTES, MAX_PARTS, part_size_for

    TiB = 1 << 40
    for base in (5 * MiB, 32 * MiB, 4 << 30):
        sizes = [part_size_for(n, base) for n in range(1, MAX_PARTS + 1)]
        assert sizes[0] == base and sizes == sorted(sizes) and max(sizes) <= MAX_PART_BYTES
        assert sum(sizes) >= 4.8 * TiB  # S3's largest object is 5 TiB
    assert [part_size_for(n, 32 * MiB) for n in (1000, 1001, 2001)] == [32 * MiB, 64 * MiB, 128 * MiB]


def test_part_size_is_bounded_by_s3s_limits(clean_env):
    for bad in (5 * MiB - 1, (4 << 30) + 1):
        with pytest.raises(ValueError, match="part_size"):
            WriterConfig(storage_config=StorageConfig(part_size=bad))
    assert WriterConfig(storage_config=StorageConfig(part_size=4 << 30)).storage_config.part_size == 4 << 30
