"""Which node a rank runs on, and which nodes keep a copy of each node's fast tier (the partner rule).

A node is named by ``CKPTIO_NODE`` where set, else by torchrun's ``GROUP_RANK`` (the launcher's node
index), else by ``LOCAL_WORLD_SIZE`` (ranks per node), else by the host name. The nodes of a save are
ordered by their lowest rank; node ``i``'s fast-tier files are copied to the ``copies - 1`` nodes after it
on that ring (``i+1``, ``i+2``, ...), so each file is on ``copies`` distinct nodes and losing any
``copies - 1`` nodes (any one with ``copies=2``; any two, a node and its neighbour among them, with
``copies=3``) keeps one. Within a partner node, a rank's copy goes to the rank with the same local index
(modulo the node's rank count), so the copying spreads over the node's ranks as the files do.
"""

from __future__ import annotations

import os
import socket
from typing import Sequence

import torch.distributed as dist


def this_node() -> str:
    """This process's node: ``CKPTIO_NODE``; else ``node-<GROUP_RANK>`` (torchrun's node index); else, with
    ``LOCAL_WORLD_SIZE`` (ranks per node, numbered node by node), ``node-<rank // LOCAL_WORLD_SIZE>``; else
    the host name."""
    explicit = os.environ.get("CKPTIO_NODE")
    if explicit:
        return explicit
    group_rank = os.environ.get("GROUP_RANK")
    if group_rank is not None:
        return f"node-{group_rank}"
    per_node = os.environ.get("LOCAL_WORLD_SIZE", "")
    if per_node.isdigit() and int(per_node) > 0 and dist.is_initialized():
        return f"node-{dist.get_rank() // int(per_node)}"
    return socket.gethostname()


class NodeMap:
    """The ranks of a group by node: ``nodes[i]`` lists node ``i``'s group ranks, nodes ordered by their
    lowest rank."""

    def __init__(self, node_of_rank: Sequence[str]):
        order: dict[str, list[int]] = {}
        for rank, node in enumerate(node_of_rank):
            order.setdefault(node, []).append(rank)
        self.names = list(order)
        self.nodes = list(order.values())
        self.node_index = {rank: i for i, ranks in enumerate(self.nodes) for rank in ranks}

    def partner_nodes(self, node: int, copies: int) -> list[int]:
        """The nodes that keep copies of node ``node``'s files: the ``copies - 1`` after it on the ring
        (fewer when the job has fewer other nodes)."""
        count = len(self.nodes)
        return [(node + step) % count for step in range(1, min(copies, count))]

    def partners(self, rank: int, copies: int) -> list[int]:
        """The ranks that receive ``rank``'s fast-tier files, one on each partner node."""
        node = self.node_index[rank]
        local = self.nodes[node].index(rank)
        return [self.nodes[p][local % len(self.nodes[p])] for p in self.partner_nodes(node, copies)]

    def sources(self, rank: int, copies: int) -> list[int]:
        """The ranks whose files ``rank`` receives (in rank order)."""
        return [other for other in sorted(self.node_index) if rank in self.partners(other, copies)]
