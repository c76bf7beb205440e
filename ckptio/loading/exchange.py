"""Every rank's small value on every rank: the exchanges loads, ``ckptio.latest`` and the tiers make
between their collectives (needs, offers, node names, what each rank holds).

Over gloo, torch's ``all_gather_object`` is a ring: a step per rank, each waiting for the next process
to be scheduled. Four ranks on this 2-core machine took 7.7 ms per exchange (median of 40); each rank
sending its value to the group's first rank, which hands the list back in one broadcast, took 2.9 ms.
Elsewhere (NCCL: its objects travel through the current GPU) torch's own is used."""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

#: The tag of an exchange's messages, apart from the fetch's (tagged by message number).
EXCHANGE_TAG = 0x636B70


def all_objects(value: Any, group: Any = None) -> list:
    """Every rank's ``value`` (picklable), in group rank order; every rank of ``group`` (``None``: the
    default group) calls it."""
    world = dist.get_world_size(group)
    if "gloo" not in str(dist.get_backend(group)):
        out: list = [None] * world
        dist.all_gather_object(out, value, group=group)
        return out
    box: list = [None]
    if dist.get_rank(group) == 0:
        box[0] = [value, *_received(group, world)]
    else:
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
        size = torch.tensor([len(data)], dtype=torch.int64)
        for work in [dist.isend(message, group=group, group_dst=0, tag=EXCHANGE_TAG) for message in (size, data)]:
            work.wait()
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def _received(group: Any, world: int) -> list:
    """The values every other rank sent the first rank, received from all at once."""
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(1, world)]
    for work in [dist.irecv(s, group=group, group_src=src, tag=EXCHANGE_TAG) for src, s in enumerate(sizes, 1)]:
        work.wait()
    data = [torch.empty(int(size), dtype=torch.uint8) for size in sizes]
    for work in [dist.irecv(d, group=group, group_src=src, tag=EXCHANGE_TAG) for src, d in enumerate(data, 1)]:
        work.wait()
    return [pickle.loads(d.numpy().tobytes()) for d in data]  # noqa: S301 - our own ranks' values
