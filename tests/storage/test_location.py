"""Checkpoint ids and URLs (``ckptio.storage.location``)."""

from __future__ import annotations

import ckptio


def test_checkpoint_ids_fsspec_cannot_open_are_not_claimed():
    for good in ("/tmp/x", "s3://bucket/key", "memory://x", "file:///tmp/x"):
        assert ckptio.Writer.validate_checkpoint_id(good) and ckptio.Reader.validate_checkpoint_id(good)
    for bad in ("nosuchproto://bucket/x", ""):
        assert not ckptio.Writer.validate_checkpoint_id(bad) and not ckptio.Reader.validate_checkpoint_id(bad)
