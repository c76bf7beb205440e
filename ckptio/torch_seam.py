"""What ckptio takes from torch beyond its public API, in one place, the public API preferred wherever
torch has one. Each name is checked on the two torches ``make test`` runs (2.13.0, and 2.15.0 for the
protocol tests; 2.14.1 ran them before 2.15): ``tests/test_torch_seam.py`` finds each there, so a release
that moves one fails by name."""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

# Staging: torch's host copies of a state (fresh, or into buffers kept).
from torch.distributed._shard.sharded_tensor import ShardedTensor  # FSDP1's sharded state dicts
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

# The planner's deduplication of replicated items (ckptio.SavePlanner keeps torch's policy, linear time).
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

# A state dict's flattened keys, as DCP stores them (HFReader maps safetensors names onto them).
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

# ckptio convert: load a whole checkpoint without a state to load into.
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

try:  # public from torch 2.15 on (the private module then warns that it is deprecated)
    from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader, FsspecWriter
except ImportError:  # torch 2.13, 2.14
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

try:  # torch 2.15 (the issue reports 2.14 too): a local tensor carrying its global shape and offsets
    from torch.distributed.checkpoint.protocol import CheckpointableTensor
except ImportError:  # torch 2.13
    CheckpointableTensor = None

#: The fields a ``CheckpointableTensor`` carries (the protocol's, public).
CHECKPOINTABLE_FIELDS = ("global_shape", "global_offsets", "local_offsets", "local_sizes")

#: Where ``dcp.load`` calls ``StorageReader.read_metadata`` from, with its ``_DistWrapper`` in ``distW``.
_LOAD_FRAME = ("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict")
#: Where ``dcp.save`` (and ``dcp.async_save``'s background save) sets its ``StorageWriter`` up, likewise.
_SAVE_FRAME = ("torch.distributed.checkpoint.state_dict_saver", "_save_state_dict")


def enclosing_load_wrapper(frame: Any) -> Any:
    """The ``_DistWrapper`` (its ``use_dist`` and ``group``) of the ``dcp.load`` whose frame encloses
    ``frame``: torch gives ``read_metadata`` no process group. ``None`` outside ``dcp.load``, or where a
    torch release renamed the function or the variable (every rank then reads for itself)."""
    return _enclosing_wrapper(frame, _LOAD_FRAME)


def enclosing_save_wrapper(frame: Any) -> Any:
    """The ``_DistWrapper`` of the ``dcp.save`` whose frame encloses ``frame``: torch gives
    ``set_up_storage_writer`` its rank in the save's process group, not the group. ``None`` outside it, or
    where a torch release renamed the function or the variable."""
    return _enclosing_wrapper(frame, _SAVE_FRAME)


def _enclosing_wrapper(frame: Any, where: tuple[str, str]) -> Any:
    while frame is not None:
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) == where:
            return frame.f_locals.get("distW")
        frame = frame.f_back
    return None


def cached_save_plan_items(planner: Any) -> list:
    """The items of the local plan ``DefaultSavePlanner(enable_plan_caching=True)`` cached for this rank
    (torch sends an empty plan when it is unchanged); ``[]`` without a cache."""
    cache = getattr(planner, "_cached_save_plan", None) or {}
    plan = cache.get(getattr(planner, "_cached_plans_key", None))
    return list(plan.items) if plan is not None else []


def process_executor_running() -> bool:
    """Whether torch's PROCESS executor for ``dcp.async_save`` has started its background process
    (``True`` where torch has no such executor, or it was never imported)."""
    module = sys.modules.get("torch.distributed.checkpoint._async_process_executor")
    return module is None or getattr(module, "_CHECKPOINT_PROCESS", True) is not None


def default_store() -> object:
    """The default process group's rendezvous store (a save without a coordinator leaves its attempt's
    token there); ``AttributeError`` where a torch release moved it."""
    return dist.distributed_c10d._get_default_store()


__all__ = [
    "CHECKPOINTABLE_FIELDS",
    "CheckpointableTensor",
    "FsspecReader",
    "FsspecWriter",
    "ShardedTensor",
    "_EmptyStateDictLoadPlanner",
    "_copy_state_dict",
    "_create_cpu_state_dict",
    "_load_state_dict",
    "cached_save_plan_items",
    "dedup_save_plans",
    "default_store",
    "enclosing_load_wrapper",
    "enclosing_save_wrapper",
    "flatten_state_dict",
    "process_executor_running",
]
