"""Who writes what in a save without a coordinator, decided by each rank alone from what it holds.

A DTensor's local chunk is held alike by every rank whose mesh coordinates differ from this rank's only
along the mesh dimensions its placements replicate (``Replicate``, and ``Partial`` as torch's planner
treats it); each of them computes the same list of those ranks and the same writer: the lowest
(``replica_group``: only the first replica group writes) or, in ``all_ranks``, the least loaded of them
over the chunks that list of ranks holds together, largest first (as ``planning.assign_writers``
spreads them). Everything else (objects, plain tensors) is written by every rank holding it, since no
rank knows who else does; the load keeps one copy of equal values (``format/fragments.py``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Callable

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.tensor import DTensor

from ckptio.format.fragments import Replica
from ckptio.saving.planning import item_size


@dataclasses.dataclass
class OwnWrites:
    """This rank's part of a save without a coordinator."""

    written: dict[MetadataIndex, WriteItem]  # stored key -> the item as the planner names it
    replicas: list[Replica]  # chunks it holds and another rank writes


def own_writes(
    held: dict[MetadataIndex, WriteItem],
    state: dict[str, Any],
    rank: int,
    mode: str,
    members: tuple[int, ...] | None = None,
) -> OwnWrites:
    """Split what this rank holds (``held``: stored key -> item; ``state``: the planner's flat state dict)
    into what it writes and the chunks it leaves to another holder. ``rank``: this rank's in the save's
    process group; ``members``: that group's global ranks by group rank (``None``: the default group). A
    replica held outside the group is no writer: the group's holders decide among themselves."""
    position = None if members is None else {member: r for r, member in enumerate(members)}
    me = rank if members is None else members[rank]

    def holders_of(item: WriteItem) -> tuple[int, ...]:
        value = state.get(item.index.fqn)
        if not isinstance(value, DTensor):
            return (rank,)
        holders = replica_ranks(value, me)
        return holders if position is None else tuple(sorted(position[h] for h in holders if h in position))

    return split_by_holders(held, holders_of, rank, mode)


def split_by_holders(
    held: dict[MetadataIndex, WriteItem], holders_of: Callable[[WriteItem], tuple[int, ...]], rank: int, mode: str
) -> OwnWrites:
    """``own_writes`` given each item's holders (ascending ranks, this one among them) by ``holders_of``."""
    written: dict[MetadataIndex, WriteItem] = {}
    shared: dict[tuple[int, ...], list[tuple[MetadataIndex, WriteItem]]] = defaultdict(list)
    for index, item in held.items():
        holders = holders_of(item)
        if len(holders) == 1:
            written[index] = item
        else:
            shared[holders].append((index, item))
    replicas = []
    for holders, items in shared.items():
        for (index, item), writer in zip(items, _writers(holders, items, mode), strict=True):
            if writer == rank:
                written[index] = item
            else:
                replicas.append(Replica(index.fqn, tuple(index.offset or ()), writer))
    return OwnWrites(written, replicas)


def replica_ranks(tensor: DTensor, rank: int) -> tuple[int, ...]:
    """The global ranks holding the same chunk of ``tensor`` as ``rank`` (itself included), ascending."""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not in this tensor's mesh: it holds nothing of it to share
        return (rank,)
    replicated = {
        dim for dim, placement in enumerate(tensor.placements) if placement.is_replicate() or placement.is_partial()
    }
    if not replicated:
        return (rank,)
    box = tuple(slice(None) if dim in replicated else c for dim, c in enumerate(coordinate))
    return tuple(sorted(mesh.mesh[box].flatten().tolist()))


def _writers(holders: tuple[int, ...], items: list[tuple[MetadataIndex, WriteItem]], mode: str) -> list[int]:
    """The writer of each of the chunks ``holders`` hold together, the same on every one of them."""
    if mode == "replica_group":
        return [holders[0]] * len(items)
    order = sorted(
        range(len(items)), key=lambda i: (-item_size(items[i][1]), items[i][0].fqn, tuple(items[i][0].offset or ()))
    )
    load = dict.fromkeys(holders, 0)
    writers = [0] * len(items)
    for i in order:
        writer = min(holders, key=lambda r: (load[r], r))
        load[writer] += item_size(items[i][1])
        writers[i] = writer
    return writers
