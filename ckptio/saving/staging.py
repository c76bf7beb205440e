"""Staging for ``dcp.async_save`` into host buffers made once and reused: ``ckptio.Stager``,
and the process-wide one every ``ckptio.Writer`` stages with when no ``async_stager`` is given.

torch's default stager copies the state into freshly allocated memory on every save (and with
the PROCESS executor pickles those bytes again into shared memory), so each save pays for page
faults and host memory grows while old copies wait to be freed. A ``Stager`` keeps up to
``slots`` sets of buffers (pinned when the state is on a GPU). A save takes a set whose last
save has returned (``ordering.py`` knows when), else makes a new set while fewer than ``slots``
exist, else waits for the set used longest ago: saves awaited one by one keep one copy of the
state, and at most ``slots`` copies ever exist. Tensors shared with the PROCESS executor's
background process are moved to shared memory by torch once, on first use.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from ckptio.saving import ordering
from ckptio.torch_seam import (
    CHECKPOINTABLE_FIELDS,
    CheckpointableTensor,
    ShardedTensor,
    _copy_state_dict,
    _create_cpu_state_dict,
)

log = logging.getLogger(__name__)

#: Sets of buffers the Writer's own staging keeps at most (one while each save is awaited before
#: the next, two when a save starts while the previous one still runs).
WRITER_STAGING_SLOTS = 2
#: How long a save waits for the previous one to return before it takes a new set of buffers
#: instead (torch's executor thread exits just after the save's future completes).
REUSE_WAIT_S = 0.05


class Stager(AsyncStager):
    """Pass as ``dcp.async_save(state, storage_writer=ckptio.Writer(url), async_stager=stager)``,
    the same stager for every save of the job; ``close()`` it at the end. Without it, a
    ``ckptio.Writer`` stages into a process-wide ``Stager`` of its own (``Writer.stage``)."""

    _synchronize_after_execute = False

    def __init__(self, slots: int = 2):
        if slots < 1:
            raise ValueError(f"Stager needs at least one slot, got {slots}")
        self._slots: list[dict[str, Any] | None] = [None] * slots
        self._users: list[ordering.Ticket | None] = [None] * slots
        self._last_use = [0] * slots
        self._uses = 0
        self._lock = threading.Lock()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        user = ordering.claim_latest()
        ordering.await_previous_start(user)
        return self.stage_for(state_dict, user)

    @torch.no_grad()
    def stage_for(self, state_dict: dict[str, Any], user: ordering.Ticket | None) -> dict[str, Any]:
        """Stage ``state_dict`` for the save holding ticket ``user`` (``None``: a save nothing
        tells the end of, staged into fresh memory)."""
        if user is None:  # not a ckptio.Writer's save: nothing tells when it is done with buffers
            log.warning("ckptio.Stager: this save's writer is not a new ckptio.Writer; staging into fresh memory")
            return stage_fresh(state_dict)
        with self._lock:  # saves may be started from more than one thread
            slot = self._pick_slot()
            self._users[slot] = user
            self._uses += 1
            self._last_use[slot] = self._uses
        on_gpu = _on_gpu(state_dict)
        buffers = self._slots[slot]
        if buffers is None or not _same_layout(state_dict, buffers):
            buffers = self._slots[slot] = _create_cpu_state_dict(state_dict, pin_memory=on_gpu)
        return _copy_into(state_dict, buffers, on_gpu)

    def _pick_slot(self) -> int:
        """A set whose save has returned, else one never taken, else (after waiting) the oldest."""
        taken = [i for i, user in enumerate(self._users) if user is not None]
        oldest_first = sorted(taken, key=lambda i: self._last_use[i])
        for i in oldest_first:
            if self._users[i].finished(REUSE_WAIT_S if i == oldest_first[0] else 0.0):
                return i
        if len(taken) < len(self._slots):
            return next(i for i, user in enumerate(self._users) if user is None)
        self._users[oldest_first[0]].wait_until_finished()
        return oldest_first[0]

    @property
    def buffer_sets(self) -> int:
        """Sets of staging buffers held now (each one copy of a state's tensors)."""
        return sum(buffers is not None for buffers in self._slots)

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """Drop the buffers (a save in flight keeps its own reference to what it reads)."""
        with self._lock:
            self._slots = [None] * len(self._slots)
            self._users = [None] * len(self._users)


@torch.no_grad()
def stage_fresh(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A host copy of ``state_dict`` in newly allocated memory (what torch's default stager makes)."""
    on_gpu = _on_gpu(state_dict)
    return _copy_into(state_dict, _create_cpu_state_dict(state_dict, pin_memory=on_gpu), on_gpu)


def _copy_into(state_dict: dict[str, Any], buffers: dict[str, Any], on_gpu: bool) -> dict[str, Any]:
    """Copy the state's tensors into ``buffers``; the staged dict, with its own mutable objects."""
    staged = _copy_state_dict(state_dict, buffers, type_check=False)
    if on_gpu:
        torch.cuda.synchronize()  # the device-to-host copies must be done before training goes on
    _carry_checkpointable_fields(state_dict, staged)
    return _copy_objects(staged)


def _checkpointable(tensor: torch.Tensor) -> bool:
    # A runtime-checkable Protocol's isinstance probes every field (~10 us a tensor: 90 ms per walk of a
    # 9,000-tensor state on an async save's blocking path); a plain tensor fails the first lookup.
    return hasattr(tensor, CHECKPOINTABLE_FIELDS[0]) and isinstance(tensor, CheckpointableTensor)


def holds_checkpointable(value: Any) -> bool:
    """Whether ``value`` (a state dict or part of one) holds a ``CheckpointableTensor``."""
    if CheckpointableTensor is None:
        return False
    if isinstance(value, torch.Tensor):
        return _checkpointable(value)
    if isinstance(value, Mapping):
        return any(holds_checkpointable(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(holds_checkpointable(v) for v in value)


def _carry_checkpointable_fields(source: Any, staged: Any) -> None:
    """Give each staged copy of a ``CheckpointableTensor`` (a local tensor that names its global shape and
    offsets) the fields of the tensor it copies, on every staging: a copy without them is a plain tensor,
    and every rank's shard would look like one replicated tensor. Reused buffers get this save's fields."""
    if CheckpointableTensor is None:
        return
    if isinstance(source, torch.Tensor):
        if _checkpointable(source) and isinstance(staged, torch.Tensor):
            for name in CHECKPOINTABLE_FIELDS:
                setattr(staged, name, getattr(source, name))
    elif isinstance(source, Mapping) and isinstance(staged, Mapping):
        for key, value in source.items():
            if key in staged:
                _carry_checkpointable_fields(value, staged[key])
    elif isinstance(source, (list, tuple)) and isinstance(staged, (list, tuple)) and len(source) == len(staged):
        for value, copy in zip(source, staged, strict=True):
            _carry_checkpointable_fields(value, copy)


_writer_stager: Stager | None = None
_writer_stager_lock = threading.Lock()


def writer_stager() -> Stager:
    """The process-wide Stager that ``ckptio.Writer.stage`` uses (made on first use)."""
    global _writer_stager
    with _writer_stager_lock:
        if _writer_stager is None:
            _writer_stager = Stager(WRITER_STAGING_SLOTS)
        return _writer_stager


def release_staging_buffers() -> None:
    """Free the host buffers ``ckptio.Writer`` keeps for ``dcp.async_save`` (up to two copies of
    the state's tensors): call it when a job saves no more, or before memory is needed elsewhere.
    The next async save allocates them again."""
    with _writer_stager_lock:
        if _writer_stager is not None:
            _writer_stager.close()


def _same_layout(value: Any, buffer: Any) -> bool:
    """Whether ``buffer`` can take a copy of ``value``: the same keys, and tensors of the same
    dtype and shape (and, for DTensors, the same mesh and placements, which the staged copy keeps).
    torch's ``_check_state_dict_similarity`` copies every DTensor while it compares: a second copy."""
    if isinstance(value, DTensor):
        return (
            isinstance(buffer, DTensor)
            and value.placements == buffer.placements
            and value.device_mesh == buffer.device_mesh
            and value.shape == buffer.shape
            and _same_layout(value._local_tensor, buffer._local_tensor)
        )
    if isinstance(value, ShardedTensor) or isinstance(buffer, (DTensor, ShardedTensor)):
        return False  # legacy ShardedTensors are staged afresh each time
    if isinstance(value, torch.Tensor):
        return isinstance(buffer, torch.Tensor) and value.dtype == buffer.dtype and value.shape == buffer.shape
    if isinstance(value, dict):
        return (
            isinstance(buffer, dict)
            and value.keys() == buffer.keys()
            and all(_same_layout(v, buffer[k]) for k, v in value.items())
        )
    if isinstance(value, (list, tuple)):
        return (
            isinstance(buffer, (list, tuple))
            and len(value) == len(buffer)
            and all(_same_layout(v, b) for v, b in zip(value, buffer, strict=True))
        )
    return not isinstance(buffer, torch.Tensor)


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _on_gpu(state_dict: dict[str, Any]) -> bool:
    return any(getattr(t, "_local_tensor", t).device.type == "cuda" for t in _tensors(state_dict))


def _copy_objects(value: Any) -> Any:
    """The staged dict holds the caller's own non-tensor values: copy the mutable ones, so that
    training may change them while the save runs."""
    if isinstance(value, torch.Tensor) or isinstance(value, (int, float, str, bytes, bool, type(None))):
        return value
    if isinstance(value, dict):
        return {k: _copy_objects(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_objects(v) for v in value]
    return copy.deepcopy(value)
