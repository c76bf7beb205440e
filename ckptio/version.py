"""ckptio's version: written into every checkpoint's metadata (``written_by``) and, through
``pyproject.toml``, the package's."""

__version__ = "1.0.0"
