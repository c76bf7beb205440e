"""What ckptio takes from torch beyond its public API, in one place: each name with the torch releases
it was checked on (2.13.0, 2.14.1, 2.15.0) and the public API preferred wherever torch has one.
``tests/test_torch_seam.py`` imports each on every torch the suite runs on, so a release that moves
one fails there by name."""

from __future__ import annotations

try:  # public from torch 2.15 on (the private module then warns that it is deprecated)
    from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader, FsspecWriter
except ImportError:  # torch 2.13, 2.14
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

__all__ = ["FsspecReader", "FsspecWriter"]
