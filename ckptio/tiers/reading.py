"""A tiered load: each byte from the nearest tier holding a verified copy.

The metadata comes from a node's fast tier when one holds it (sent to the other ranks by the lowest
rank that does), else from the durable tier. Data files the node holds whole, and replicas its
ranks kept, are read from the fast tier; everything else from the durable tier. Every block is
checked against its CRC32C as on any load; a fast-tier file that fails a check (or is missing or
short) is dropped and its items read again from the durable tier (``Reader.read_data``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.distributed as dist

from ckptio.format.names import METADATA_NAME
from ckptio.loading.read_once import read_on
from ckptio.storage import FsspecStore, ReadRequest


def tiered_metadata_bytes(local: FsspecStore, read_durable: Callable[[], bytes], group: Any, direct: Any) -> bytes:
    """``ckptio.json`` from the lowest rank of ``group`` whose fast tier holds it, else read from the
    durable tier by the group's lowest rank; every rank gets the bytes or the error."""
    has_local = local.exists(METADATA_NAME)
    if group is direct or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local.read(METADATA_NAME) if has_local else read_durable()
    flags: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, has_local, group=group)
    source = flags.index(True) if True in flags else 0
    return read_on(lambda: local.read(METADATA_NAME) if has_local else read_durable(), group, source)


class TieredSource:
    """A byte source (``loading.sources.ByteSource``) reading the files named in ``local_names`` from
    the fast tier and every other one from the durable tier, counting the bytes each serves."""

    def __init__(self, local: FsspecStore, durable: FsspecStore, local_names: set[str], reads_durable: bool):
        self.local, self.durable, self.local_names = local, durable, set(local_names)
        self.url = durable.url
        self.remote = durable.remote and reads_durable
        self.read_gap_bytes = durable.read_gap_bytes if self.remote else local.read_gap_bytes
        self.bytes_read = {"local": 0, "durable": 0}

    def _tier(self, name: str) -> tuple[str, FsspecStore]:
        return ("local", self.local) if name in self.local_names else ("durable", self.durable)

    def read_into(self, requests: Sequence[ReadRequest]) -> list[int]:
        counts = [0] * len(requests)
        for tier, store in (("local", self.local), ("durable", self.durable)):
            picked = [i for i, r in enumerate(requests) if self._tier(r.name)[0] == tier]
            if picked:
                for i, got in zip(picked, store.read_into([requests[i] for i in picked]), strict=True):
                    counts[i] = got
                    self.bytes_read[tier] += got
        return counts

    def describe(self, name: str) -> str:
        return self._tier(name)[1].describe(name)

    def size(self, name: str) -> int:
        return self._tier(name)[1].size(name)

    def exists(self, name: str) -> bool:
        return self._tier(name)[1].exists(name)
