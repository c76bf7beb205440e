"""ckptio: a PyTorch Distributed Checkpoint writer and reader for S3 and shared filesystems."""

from ckptio import deprecated_paths
from ckptio.api import load, save, unwrap  # noqa: E402
from ckptio.config import StorageConfig, WriterConfig  # noqa: E402
from ckptio.errors import (  # noqa: E402
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LossyConversionError,
    MixedFragmentsError,
    NotCkptioCheckpointError,
    PerRankStateError,
    StorageError,
    UnsafeObjectError,
)
from ckptio.hf.export import export_safetensors  # noqa: E402
from ckptio.hf.reader import HFReader  # noqa: E402
from ckptio.loading.reader import Reader  # noqa: E402
from ckptio.loading.safe_load import SafeLoadPlanner  # noqa: E402
from ckptio.saving.planner import SavePlanner  # noqa: E402
from ckptio.saving.staging import Stager, release_staging_buffers  # noqa: E402
from ckptio.saving.writer import Writer  # noqa: E402
from ckptio.state.per_rank import PerRank  # noqa: E402
from ckptio.tiers.drain import DrainError, uploads_pending, wait_for_uploads  # noqa: E402
from ckptio.tiers.latest import latest  # noqa: E402
from ckptio.version import __version__  # noqa: E402

deprecated_paths.install()


def __getattr__(name: str):
    return deprecated_paths.moved_attribute(name)


__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DrainError",
    "HFReader",
    "IncompleteCheckpointError",
    "LossyConversionError",
    "MixedFragmentsError",
    "NotCkptioCheckpointError",
    "PerRank",
    "PerRankStateError",
    "Reader",
    "SafeLoadPlanner",
    "SavePlanner",
    "Stager",
    "StorageConfig",
    "StorageError",
    "UnsafeObjectError",
    "Writer",
    "WriterConfig",
    "__version__",
    "export_safetensors",
    "latest",
    "load",
    "release_staging_buffers",
    "save",
    "unwrap",
    "uploads_pending",
    "wait_for_uploads",
]
