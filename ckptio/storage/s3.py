"""S3 specifics (via s3fs): for now the generic fsspec behaviour."""

from __future__ import annotations

from .base import FsspecStore


class S3Store(FsspecStore):
    pass
