"""State that differs on every data-parallel rank (dataloader position, RNG state).

Wrap it with ``ckptio.PerRank(value, dp_rank=..., dp_size=...)``: each rank's value is stored
under its own key, and the data-parallel size is recorded, so a resume on another size fails
with the saved and current sizes instead of a bare missing key, unless you chose a policy.
"""

from __future__ import annotations

import dataclasses
import io
import re
from typing import Any, Callable

import torch

from ckptio.errors import PerRankStateError
from ckptio.state.safe_pickle import safe_unpickle

_MARK = "__per_rank__"
_SLOT = re.compile(r"^(\d+)_of_(\d+)$")


@dataclasses.dataclass
class PerRank:
    """One value per data-parallel rank.

    ``on_resize`` says what a load on a different data-parallel size does: ``"error"`` (the
    default) raises ``PerRankStateError``; ``"skip"`` leaves ``value`` as it is; a function
    ``f(saved_values: list, new_dp_size: int) -> list`` redistributes the saved values.
    After ``ckptio.load``, ``value`` holds this rank's restored value.

    Example::

        state["dataloader"] = ckptio.PerRank(loader.state_dict(), dp_rank=dp_rank, dp_size=dp_size)
    """

    value: Any
    dp_rank: int
    dp_size: int
    on_resize: str | Callable[[list, int], list] = "error"

    def __post_init__(self) -> None:
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"PerRank: dp_rank {self.dp_rank} is not within dp_size {self.dp_size}")
        if not (callable(self.on_resize) or self.on_resize in ("error", "skip")):
            raise ValueError(f"PerRank: on_resize must be 'error', 'skip' or a function, got {self.on_resize!r}")

    def __reduce__(self):
        raise PerRankStateError("ckptio.PerRank must be saved and loaded with ckptio.save / ckptio.load")


def _slot(rank: int, size: int) -> str:
    return f"{rank}_of_{size}"


def _pack(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unpack(raw: bytes) -> Any:
    return safe_unpickle(io.BytesIO(raw))


def expand_for_save(state: dict[str, Any]) -> dict[str, Any]:
    """Replace each ``PerRank`` (in place in ``state``, a dict ckptio owns) by its per-rank key."""
    for key, value in list(state.items()):
        if isinstance(value, PerRank):
            state[key] = {_MARK: {_slot(value.dp_rank, value.dp_size): _pack(value.value)}}
        elif isinstance(value, dict):
            expand_for_save(value)
    return state


def saved_sizes(state_keys: list[str], path: str) -> dict[int, set[int]]:
    """From the checkpoint's keys: data-parallel size -> saved ranks, for the PerRank at ``path``."""
    prefix = f"{path}.{_MARK}."
    sizes: dict[int, set[int]] = {}
    for key in state_keys:
        if key.startswith(prefix):
            m = _SLOT.match(key[len(prefix) :])
            if m:
                sizes.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    return sizes


def prepare_for_load(state: dict[str, Any], checkpoint_keys: list[str], path: str = "") -> list[Callable[[], None]]:
    """Replace each ``PerRank`` (in ``state``, a dict ckptio owns) by the keys to load for it;
    return the steps that, after the load, put the restored values into the ``PerRank`` objects."""
    finish: list[Callable[[], None]] = []
    for key, value in list(state.items()):
        where = f"{path}.{key}" if path else str(key)
        if isinstance(value, dict):
            finish += prepare_for_load(value, checkpoint_keys, where)
        if not isinstance(value, PerRank):
            continue
        sizes = saved_sizes(checkpoint_keys, where)
        if not sizes:
            raise PerRankStateError(
                f"per-rank state {where!r} is not in the checkpoint (it was not saved with ckptio.PerRank)"
            )
        ((saved_size, ranks),) = sizes.items()
        if ranks != set(range(saved_size)):
            raise PerRankStateError(f"per-rank state {where!r} lacks ranks {sorted(set(range(saved_size)) - ranks)}")
        if saved_size == value.dp_size:
            slots = {_slot(value.dp_rank, saved_size): None}
        elif value.on_resize == "error":
            raise PerRankStateError(
                f"per-rank state {where!r} was saved by {saved_size} data-parallel ranks, but this job has "
                f"{value.dp_size}: their values cannot be matched one to one. Pass on_resize='skip' to start it "
                "fresh, or a function f(saved_values, new_dp_size) -> values that redistributes it"
            )
        elif value.on_resize == "skip":
            del state[key]
            continue
        else:
            slots = {_slot(r, saved_size): None for r in range(saved_size)}
        state[key] = {_MARK: slots}
        finish.append(_restore(value, slots, saved_size, where))
    return finish


def _restore(target: PerRank, slots: dict[str, Any], saved_size: int, where: str) -> Callable[[], None]:
    def restore() -> None:
        if saved_size == target.dp_size:
            target.value = _unpack(slots[_slot(target.dp_rank, saved_size)])
            return
        saved = [_unpack(slots[_slot(r, saved_size)]) for r in range(saved_size)]
        values = list(target.on_resize(saved, target.dp_size))
        if len(values) != target.dp_size:
            raise PerRankStateError(
                f"the redistribution function for {where!r} returned {len(values)} values for {target.dp_size} ranks"
            )
        target.value = values[target.dp_rank]

    return restore
