"""Metadata read once per load: the lowest rank of the load's process group reads it, and the
bytes (or the error) reach every other rank over that group, instead of every rank sending the
same GET (1,024 GETs of one object at 1,024 ranks, against per-prefix request limits).

torch's ``StorageReader.read_metadata`` is given no process group, but ``dcp.load`` calls it on
every rank of its group at the same point, from ``_load_state_dict``, whose ``distW`` holds the
group. ``load_group`` finds it there; when it cannot (another torch, another caller, a load
without collectives) every rank reads for itself, as torch's own readers do.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from ckptio.errors import CheckpointError
from ckptio.loading.exchange import all_objects
from ckptio.loading.together import fail_together
from ckptio.torch_seam import enclosing_load_wrapper

T = TypeVar("T")

#: ``read_once``'s group for "read on this rank alone".
DIRECT = object()


def load_group() -> Any:
    """The process group of the ``dcp.load`` this call runs inside (``None``: the default group),
    or ``DIRECT`` when there is none or it runs without collectives."""
    wrapper = enclosing_load_wrapper(sys._getframe(1))
    if wrapper is None or not getattr(wrapper, "use_dist", False):
        return DIRECT
    return getattr(wrapper, "group", DIRECT)


def read_once(
    read: Callable[[], T],
    group: Any,
    location: str,
    each_rank_reads: bool = False,
    read_for_all: Callable[[], T] | None = None,
) -> T:
    """One answer for every rank of ``group`` (``None``: the default group): the lowest rank's
    ``read_for_all()`` (default ``read``), its result or the ``CheckpointError`` it raised, handed to the
    others. With ``each_rank_reads`` (where a read costs less than sending its result) every rank first
    reads ``read()``, bytes, and the ranks compare digests: where all read the same bytes each keeps its
    own, else the lowest rank's answer is everyone's, so no two ranks go on with different documents (one
    read before a commit, another after it). Ranks that name different ``location``s each read their own,
    and a failure on any of them fails all. ``DIRECT``, a single rank or no initialised process group:
    ``read_for_all()`` here. One exchange, then at most one broadcast."""
    read_for_all = read_for_all or read
    if group is DIRECT or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return read_for_all()
    mine = outcome(read) if each_rank_reads else None
    digest = hashlib.blake2b(mine[1], digest_size=16).digest() if mine is not None and mine[0] else None
    views = all_objects((location, digest), group)
    if any(where != location for where, _ in views):  # ranks load different checkpoints: each its own
        own = mine if mine is not None and mine[0] else outcome(read_for_all)
        fail_together(None if own[0] else own[1], group)
        return result(own)
    if digest is not None and all(theirs == digest for _, theirs in views):
        return result(mine)
    return read_on(read_for_all, group, 0)


def read_on(read: Callable[[], T], group: Any, source: int) -> T:
    """``read()`` on rank ``source`` of ``group``; its result, or the ``CheckpointError`` it raised,
    on every rank of the group (which all call this)."""
    box: list = [None]
    if dist.get_rank(group) == source:
        box[0] = outcome(read)
    dist.broadcast_object_list(box, group=group, group_src=source)
    return result(box[0])


def outcome(read: Callable[[], T]) -> tuple[bool, Any]:
    """``(True, read())``, or ``(False, the error)`` as a ``CheckpointError`` (that ``result`` raises)."""
    try:
        return True, read()
    except CheckpointError as exc:
        return False, exc
    except Exception as exc:  # noqa: BLE001 - the other ranks wait in a collective: they must hear of it
        return False, CheckpointError(f"rank {dist.get_rank()} failed reading: {type(exc).__name__}: {exc}")


def result(of: tuple[bool, Any]) -> Any:
    """The value of an ``outcome``, or its error raised."""
    ok, value = of
    if not ok:
        raise value
    return value
