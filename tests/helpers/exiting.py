"""A training script that ends while its background work runs: ``python -m tests.helpers.exiting SPEC``, one
process per rank (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` in its environment; ``CKPTIO_NODE`` its node).
It saves tiered, then its last line runs: no ``wait_for_uploads()``, no ``destroy_process_group()``. It
prints ``saved <unix time>`` when its saves have returned, so the caller can time the exit itself.

SPEC is JSON: ``url`` (a step URL), ``tier``, ``endpoint`` (moto's or the fault proxy's), ``bandwidth``
(``drain_bandwidth``), ``copies`` (``local_tier_copies``), ``async_saves`` (two ``dcp.async_save``s, of ``url``
and ``<url>-2``, their futures awaited; else ``dcp.save``s), ``incremental`` (against "previous"),
``collectives`` (False: saves without a coordinator), ``raise`` (the script then dies of an exception), ``stall_s``
(``process_exit.EXIT_STALL_S``, shortened for a test that waits for it)."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio import process_exit

ELEMENTS = 1 << 16  # 256 KiB of fp32 a tensor; replicated tensors are spread over the ranks to write
TENSORS = 4


def state_of(step: int) -> dict:
    return {f"w{i}": torch.full((ELEMENTS,), float(step * 100 + i)) for i in range(TENSORS)} | {"step": step}


def main(spec: dict) -> None:
    process_exit.EXIT_STALL_S = spec.get("stall_s", process_exit.EXIT_STALL_S)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
    options = {"client_kwargs": {"endpoint_url": spec["endpoint"]}, "key": "testing", "secret": "testing"}
    config = ckptio.WriterConfig(
        local_tier=spec["tier"],
        drain_bandwidth=spec.get("bandwidth"),
        local_tier_copies=spec.get("copies", 1),
        incremental_from="previous" if spec.get("incremental") else None,
    )
    urls = [spec["url"], spec["url"] + "-2"] if spec.get("async_saves") or spec.get("two_saves") else [spec["url"]]
    for step, url in enumerate(urls, 1):
        state = state_of(step)
        writer = ckptio.Writer(url, config, storage_options=options)
        collectives = {"use_collectives": spec.get("collectives", True)}
        if spec.get("async_saves"):
            dcp.async_save(state, storage_writer=writer, **collectives).result()
        else:
            dcp.save(state, storage_writer=writer, **collectives)
    print(f"saved {time.time()}", flush=True)
    if spec.get("raise"):
        raise RuntimeError("the training script failed after its save")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
