"""A tiered load's reads from other nodes: files a rank's load needs that its node does not hold are
copied, whole with their held index, from a node that does (its own copy, or a partner's copy:
``replication.py``), over the load's process group, before the load reads. What arrives is checked on
arrival as replication checks it and lands in this node's folder of the step, where it is a copy like
any other (checked against the checkpoint again by ``held_index.local_copies``, and block by block as
it is read). A replacement node (an empty fast tier) thus restarts from its partners, and holds its
ranks' copies again afterwards.

Which files: those the rank's plan reads from that its node lacks, and, where the load runs on as many
ranks as the save did, every fast-tier file of its own saving rank (its copy, for the next restart).
Each is fetched once per node (by the lowest rank that needs it), from a holder on another node (spread
over the holders); a file no node holds is read from the durable tier.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ckptio.format.names import parse_data_file_name
from ckptio.loading.read_once import DIRECT
from ckptio.storage import FsspecStore
from ckptio.tiers.held_index import LocalCopies
from ckptio.tiers.nodes import this_node
from ckptio.tiers.paths import HELD_SUFFIX
from ckptio.tiers.replication import Arrivals, move_files


def fetch_from_peers(
    group: Any, local: FsspecStore, copies: LocalCopies, needed: set[str], saved_world: int
) -> set[str]:
    """Copy ``needed`` (file names this rank reads, not on its node) and this rank's own copy from other
    nodes into ``local``; every rank of ``group`` calls it. The files this node now holds from peers
    (none without a process group)."""
    if group is DIRECT or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return set()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    offered = {name: size for name, size in copies.sizes.items() if _index_size(local, name) is not None}
    view = (this_node(), sorted(needed), {n: [s, _index_size(local, n)] for n, s in offered.items()})
    views: list = [None] * world
    dist.all_gather_object(views, view, group=group)
    for other in range(world):  # its own saving rank's copy, where the ranks map one to one
        if world == saved_world:
            own = {name for _, _, held in views for name in held if parse_data_file_name(name).rank == other}
            views[other][1][:] = sorted({*views[other][1], *own})
    fetches = _plan(views)
    outgoing: dict[int, list[tuple[str, int]]] = {}
    receiving: dict[int, list[tuple[str, int]]] = {}
    for receiver, holder, name in fetches:
        size, index_size = views[holder][2][name]
        files = [(name, size), (name + HELD_SUFFIX, index_size)]
        if holder == rank:
            outgoing.setdefault(receiver, []).extend(files)
        if receiver == rank:
            receiving.setdefault(holder, []).extend(files)
    incoming = {holder: Arrivals(local.root, files, holder, keep=True) for holder, files in receiving.items()}
    move_files(group, local.root, outgoing, incoming)
    got = sorted(name for arrivals in incoming.values() for name in arrivals.done if not name.endswith(HELD_SUFFIX))
    arrived: list = [None] * world
    dist.all_gather_object(arrived, (views[rank][0], got), group=group)  # and: every fetch has landed
    return {name for node, names in arrived if node == views[rank][0] for name in names}


def _plan(views: list) -> list[tuple[int, int, str]]:
    """``(receiving rank, sending rank, file)`` of each fetch: a file a node lacks, fetched once by the
    lowest of its ranks that needs it, from a rank of another node that holds it (spread over them)."""
    nodes = [node for node, _, _ in views]
    fetches = []
    for receiver, (node, needed, _) in enumerate(views):
        for name in needed:
            if any(n == node and name in held for n, _, held in views):
                continue  # the node holds it
            if any(nodes[r] == node and name in views[r][1] for r in range(receiver)):
                continue  # a lower rank of the node fetches it
            holders = [r for r, (n, _, held) in enumerate(views) if n != node and name in held]
            if holders:
                fetches.append((receiver, holders[len(fetches) % len(holders)], name))
    return fetches


def _index_size(local: FsspecStore, name: str) -> int | None:
    try:
        return local.size(name + HELD_SUFFIX)
    except (OSError, FileNotFoundError):
        return None
    except Exception:  # noqa: BLE001 - a cache: a copy that cannot be sized is not offered
        return None
