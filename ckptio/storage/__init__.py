"""Storage backends: ``open_store(url)`` picks the one for a URL's protocol."""

from __future__ import annotations

import os
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from ckptio.config import StorageConfig
from ckptio.storage.base import FsspecStore, RangeRequest, ReadRequest, Sink
from ckptio.storage.local import LocalStore

__all__ = ["FsspecStore", "LocalStore", "RangeRequest", "ReadRequest", "Sink", "StorageConfig", "open_store"]


def open_store(
    url: str | os.PathLike, storage_options: dict[str, Any] | None = None, config: StorageConfig | None = None
) -> FsspecStore:
    url = os.fspath(url)
    config = config if config is not None else StorageConfig()
    if url.startswith(("s3://", "s3a://")):
        from ckptio.storage.s3 import S3Store, s3_storage_options

        fs, root = url_to_fs(url, **s3_storage_options(storage_options))
        return S3Store(fs, root, url, config)
    protocol = url.partition("://")[0] if "://" in url else ""
    if protocol in ("gs", "gcs"):
        from ckptio.storage.gcs import GCSStore, gcs_filesystem

        fs = gcs_filesystem(storage_options)
        return GCSStore(fs, fs._strip_protocol(url), url, config)
    if protocol in ("az", "abfs", "abfss"):
        from ckptio.storage.azure import AzureStore, azure_filesystem

        fs = azure_filesystem(storage_options)
        return AzureStore(fs, fs._strip_protocol(url), url, config)
    fs, root = url_to_fs(url, **(storage_options or {}))
    if isinstance(fs, LocalFileSystem):
        return LocalStore(fs, root, url, config)
    return FsspecStore(fs, root, url, config)
