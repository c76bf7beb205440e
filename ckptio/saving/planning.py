"""Who writes what: each item goes to exactly one of the ranks that hold it.

``all_ranks`` spreads replicated items so per-rank payloads are as even as possible
(largest item first, to the least-loaded holder); ``replica_group`` gives each item to the
lowest rank holding it, so only the first HSDP replica group writes. Items held by one rank
only are always written by that rank. Pure functions over DCP save plans; no I/O.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem


@dataclasses.dataclass(frozen=True)
class Holdings:
    """Everything one rank *could* write, recorded before torch's planner deduplicates, and
    where it saves (the coordinator checks that every rank names the same checkpoint)."""

    items: tuple[WriteItem, ...]
    checkpoint_id: str | None = None


def item_size(item: WriteItem) -> int:
    # Objects are pickled later, so their size is unknown here; count them as one byte as torch does.
    return item.tensor_storage_size() or 1


@dataclasses.dataclass(frozen=True)
class Assignment:
    """The items one rank writes; ``private_only`` when no other rank holds any of them
    (per-rank state), which makes them candidates for inlining into the metadata."""

    items: list[WriteItem]
    private_only: bool


def assign_writers(plans: list[SavePlan], mode: str) -> list[Assignment]:
    """Return, for each rank, the items it writes.

    Every item present in ``plans`` (torch's deduplicated global plan) is assigned exactly
    once, to one of the ranks whose ``Holdings`` list it.
    """
    holders: dict[MetadataIndex, list[int]] = defaultdict(list)
    candidates: dict[tuple[MetadataIndex, int], WriteItem] = {}
    for rank, plan in enumerate(plans):
        held = plan.storage_data.items if isinstance(plan.storage_data, Holdings) else plan.items
        for item in held:
            holders[item.index].append(rank)
            candidates[(item.index, rank)] = item

    wanted: dict[MetadataIndex, WriteItem] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if (item.index, rank) not in candidates:  # a planner added it globally: keep it where it is
                holders[item.index] = [rank]
                candidates[(item.index, rank)] = item
            wanted.setdefault(item.index, item)

    assigned: list[list[WriteItem]] = [[] for _ in plans]
    load = [0] * len(plans)

    def give(item: WriteItem, rank: int) -> None:
        assigned[rank].append(candidates[(item.index, rank)])
        load[rank] += item_size(item)

    replicated = []
    for item in wanted.values():
        ranks = holders[item.index]
        if len(ranks) == 1 or mode == "replica_group":
            give(item, min(ranks))
        else:
            replicated.append(item)
    replicated.sort(key=lambda it: (-item_size(it), it.index.fqn, tuple(it.index.offset or ())))
    for item in replicated:
        give(item, min(holders[item.index], key=lambda r: (load[r], r)))
    return [Assignment(items, all(len(holders[it.index]) == 1 for it in items)) for items in assigned]
