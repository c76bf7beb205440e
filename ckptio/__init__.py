"""ckptio: a PyTorch Distributed Checkpoint writer and reader for S3 and shared filesystems."""

__version__ = "0.2.0"

from . import convert  # noqa: E402, F401 - ckptio.convert.load_full / to_torch_save
from .api import load, save, unwrap  # noqa: E402
from .config import WriterConfig  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LossyConversionError,
    NotCkptioCheckpointError,
    PerRankStateError,
    StorageError,
    UnsafeObjectError,
)
from .export import export_safetensors  # noqa: E402
from .hf_reader import HFReader  # noqa: E402
from .per_rank import PerRank  # noqa: E402
from .reader import Reader  # noqa: E402
from .safe_load import SafeLoadPlanner  # noqa: E402
from .save_planner import SavePlanner  # noqa: E402
from .staging import Stager, release_staging_buffers  # noqa: E402
from .writer import Writer  # noqa: E402

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "HFReader",
    "IncompleteCheckpointError",
    "LossyConversionError",
    "NotCkptioCheckpointError",
    "PerRank",
    "PerRankStateError",
    "Reader",
    "SafeLoadPlanner",
    "SavePlanner",
    "Stager",
    "StorageError",
    "UnsafeObjectError",
    "Writer",
    "WriterConfig",
    "__version__",
    "export_safetensors",
    "load",
    "release_staging_buffers",
    "save",
    "unwrap",
]
