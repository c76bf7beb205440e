"""What ranks send each other beside DCP's collectives: every rank's small value on every rank (the
exchanges loads, ``ckptio.latest`` and the tiers make: needs, offers, node names, what each rank holds),
and streams of messages between pairs of ranks (shared reads, a tiered load's fetch from other nodes).

Over gloo, torch's ``all_gather_object`` is a ring: a step per rank, each waiting for the next process
to be scheduled. Four ranks on this 2-core machine took 7.7 ms per exchange (median of 40); each rank
sending its value to the group's first rank, which hands the list back in one broadcast, took 2.9 ms.
Elsewhere (NCCL: its objects travel through the current GPU) torch's own is used."""

from __future__ import annotations

import collections
import pickle
from typing import Any, Iterable

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


def send_and_receive(
    group: Any,
    incoming: dict[int, list[torch.Tensor]],
    outgoing: dict[int, Iterable[torch.Tensor]],
    in_flight_bytes: int | None = None,
) -> None:
    """Receive each peer's messages of ``incoming`` (group rank -> the memory of each, in order) and send
    each peer of ``outgoing`` its messages: every receive posted first, then the sends, each tagged with
    its number in its peer's stream (both ends derive the same messages from their plan), so every stream
    moves at once and no rank waits on a round of another's. Beyond ``in_flight_bytes`` of sends, the
    oldest are awaited first (what an ``outgoing`` iterable gathers into memory stays bounded)."""
    pending = [
        dist.irecv(memory, group=group, group_src=peer, tag=tag)
        for peer, messages in incoming.items()
        for tag, memory in enumerate(messages)
    ]
    sending: collections.deque = collections.deque()  # (work, message): a message stays alive until sent
    in_flight = 0
    for peer, messages in outgoing.items():
        for tag, message in enumerate(messages):
            sending.append((dist.isend(message, group=group, group_dst=peer, tag=tag), message))
            in_flight += len(message)
            while in_flight_bytes is not None and in_flight > in_flight_bytes:
                work, sent = sending.popleft()
                work.wait()
                in_flight -= len(sent)
    for work in [*pending, *(work for work, _ in sending)]:
        work.wait()
