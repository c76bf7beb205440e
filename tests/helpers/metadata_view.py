"""Tests read a checkpoint's metadata in version 2's schema (a JSON object per item), through ckptio's
own readable view (``layout.legacy_document``): crafted edits of that view are version 2 documents,
which keep exercising the decoder of checkpoints written before the compact format."""

from __future__ import annotations

from typing import Any

from ckptio.legacy.v1 import legacy_document
from ckptio.tools.inspection import open_checkpoint


def readable_metadata(url: str, storage_options: dict | None = None) -> dict[str, Any]:
    _, manifest = open_checkpoint(url, storage_options)
    return legacy_document(manifest)
