"""ckptio: a PyTorch Distributed Checkpoint writer and reader for S3 and shared filesystems."""

from ckptio.api import load, save, unwrap
from ckptio.config import StorageConfig, Tuning, WriterConfig
from ckptio.errors import (
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
from ckptio.hf.export import export_safetensors
from ckptio.hf.reader import HFReader
from ckptio.loading.reader import Reader
from ckptio.loading.safe_load import SafeLoadPlanner
from ckptio.saving.planner import SavePlanner
from ckptio.saving.staging import Stager, release_staging_buffers
from ckptio.saving.writer import Writer
from ckptio.state.per_rank import PerRank
from ckptio.tiers.drain import DrainError, uploads_pending, wait_for_uploads
from ckptio.tiers.landing import TieredLanding as _TieredLanding  # noqa: F401 - registers it with saving
from ckptio.tiers.latest import latest
from ckptio.tiers.nearest import NearestTierReads as _NearestTierReads  # noqa: F401 - registers it with loading
from ckptio.version import __version__

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
    "Tuning",
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
