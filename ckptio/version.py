"""ckptio's version: written into every checkpoint's metadata (``written_by``)."""

__version__ = "0.2.0"
