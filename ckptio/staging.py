"""``ckptio.Stager``: staging for ``dcp.async_save`` into host buffers made once and reused.

torch's default stager copies the state into freshly allocated memory on every save (and with
the PROCESS executor pickles those bytes again into shared memory), so each save pays for page
faults and host memory grows while old copies wait to be freed. ``Stager`` keeps ``slots`` sets
of buffers (pinned when the state is on a GPU); a save reuses the set of the save ``slots``
before it, once that save has returned (``ordering.py`` knows when), so at most ``slots`` saves
are in flight and host memory stays at ``slots`` copies of the state. Tensors shared with the
PROCESS executor's background process are moved to shared memory by torch once, on first use.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from . import ordering

log = logging.getLogger(__name__)


class Stager(AsyncStager):
    """Pass as ``dcp.async_save(state, storage_writer=ckptio.Writer(url), async_stager=stager)``,
    the same stager for every save of the job; ``close()`` it at the end."""

    _synchronize_after_execute = False

    def __init__(self, slots: int = 2):
        if slots < 1:
            raise ValueError(f"Stager needs at least one slot, got {slots}")
        self._slots: list[dict[str, Any] | None] = [None] * slots
        self._users: list[ordering.Ticket | None] = [None] * slots
        self._next = 0

    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        slot = self._next
        self._next = (slot + 1) % len(self._slots)
        previous_user = self._users[slot]
        if previous_user is not None:
            previous_user.wait_until_finished()  # the save that last used these buffers has returned
        self._users[slot] = user = ordering.claim_latest()
        buffers = self._slots[slot]
        if user is None:  # not a ckptio.Writer's save: nothing tells when it is done with buffers
            log.warning("ckptio.Stager: this save's writer is not a new ckptio.Writer; staging into fresh memory")
            buffers = None
        on_gpu = _on_gpu(state_dict)
        if buffers is None or not _same_layout(state_dict, buffers):
            buffers = _create_cpu_state_dict(state_dict, pin_memory=on_gpu)
            self._slots[slot] = buffers if user is not None else None
        staged = _copy_state_dict(state_dict, buffers, type_check=False)
        if on_gpu:
            torch.cuda.synchronize()
        return _copy_objects(staged)

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        self._slots = [None] * len(self._slots)
        self._users = [None] * len(self._users)


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
            and all(_same_layout(v, b) for v, b in zip(value, buffer))
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
