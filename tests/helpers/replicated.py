"""Per-rank bodies of the replication tests: tiered saves whose fast-tier files are copied to a partner
node (``local_tier_copies``), on two simulated nodes of two ranks (``tiered.node_tier``)."""

from __future__ import annotations

import logging
import os
import resource
import signal

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.loading.shared_reads import Placements
from ckptio.tiers import peers, replication
from tests.helpers import tiered


def big_on_node0(mesh_shape, step: int, empty: bool = False) -> dict:
    """``tiered.state`` and a 256 KiB tensor only node 0's ranks hold (their fast-tier files are larger)."""
    value = tiered.state(mesh_shape, step, empty)
    rank = dist.get_rank()
    if rank < 2:
        value[f"extra.rank{rank}"] = torch.zeros(64 << 10) if empty else torch.full((64 << 10,), float(step + rank))
    return value


def save_and_count(run: str, tier_base: str, mesh_shape, steps, options, config: dict) -> dict:
    """Save ``steps`` with ``config``; this rank's fast-tier files of the last step (name -> size) and the
    bytes it sent to partners."""
    tiered.save_steps(run, tier_base, mesh_shape, steps, options, config)
    return {"sent": replication.bytes_sent(), "files": _own_files(run, tier_base, steps[-1], options)}


def _own_files(run: str, tier_base: str, step: int, options) -> dict[str, int]:
    folder = tiered.local_step_folder(run, tier_base, step, options)
    suffix = f"-r{dist.get_rank():05d}.ckio"
    names = [n for n in os.listdir(folder) if n.endswith(suffix) or n.endswith(suffix + ".held.json")]
    return {n: os.path.getsize(os.path.join(folder, n)) for n in names}


def save_with_a_full_partner(run: str, tier_base: str, options, config: dict) -> list[str]:
    """Node 1's ranks can keep no file over 128 KiB (as a full disk would refuse them): their own files fit,
    node 0's larger copies do not. Step 1 drains, step 2's drain is cut off. The warnings this rank logged."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ckptio").addHandler(handler)
    if dist.get_rank() >= 2:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (128 << 10, resource.RLIM_INFINITY))
    for step, drain in (
        (1, {}),
        (2, {"drain_bandwidth": 1, "tuning": {**config.get("tuning", {}), "drain_timeout_s": 0.5}}),
    ):
        writer = tiered.tiered_writer(run, step, tier_base, options, {**config, **drain})
        dcp.save(big_on_node0((2, 2), step), storage_writer=writer)
        try:
            ckptio.wait_for_uploads()
        except ckptio.DrainError:
            pass
    return records


def restart_big(run: str, tier_base: str, options) -> tuple:
    """``tiered.restart`` of ``big_on_node0`` saves: the URL, what differs, the bytes each source served."""
    tier = tiered.node_tier(tier_base)
    url = ckptio.latest(run, local_tier=tier, storage_options=options)
    step = int(url.rsplit("-", 1)[1])
    value = big_on_node0((2, 2), 0, empty=True)
    reader = ckptio.Reader(url, storage_options=options, local_tier=tier)
    dcp.load(value, storage_reader=reader)
    ckptio.wait_for_uploads()
    bad = tiered.problems(value, step)
    rank = dist.get_rank()
    if rank < 2 and not torch.equal(value[f"extra.rank{rank}"], torch.full((64 << 10,), float(step + rank))):
        bad.append(f"extra.rank{rank}")
    return url, bad, reader.bytes_read


def save_then_lose_node1(run: str, tier_base: str, mesh_shape, options, config: dict) -> str:
    """Save step 1 (drained), then step 2, after which node 1's ranks are killed (SIGKILL) as their copies
    and drain start; what ``wait_for_uploads`` raised on node 0."""
    tiered.save_steps(run, tier_base, mesh_shape, [1], options, config)
    dcp.save(tiered.state(mesh_shape, 2), storage_writer=tiered.tiered_writer(run, 2, tier_base, options, config))
    return tiered.killed_or_drained(2, 3)


def save_cut_off_and_count(run: str, tier_base: str, mesh_shape, options, config: dict, collectives: bool) -> tuple:
    """``tiered.save_with_a_stalled_drain`` (steps 1 and 2); what it raised, the bytes this rank sent to
    partners and its own fast-tier files of both steps (name -> size)."""
    raised = tiered.save_with_a_stalled_drain(run, tier_base, mesh_shape, options, collectives, config)
    own = {**_own_files(run, tier_base, 1, options), **_own_files(run, tier_base, 2, options)}
    return raised, replication.bytes_sent(), own


def fetch_streams(folder: str, lengths: list[int], window: int) -> list[str]:
    """Every rank serves every other rank ``lengths`` items of its own file (``folder/file-<rank>``, the
    items 3 bytes apart), through the fetch's transport with at most ``window`` bytes of sends in flight;
    what it received wrong (the large items are received into destinations of their own)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    offsets = [sum(lengths[:k]) + 3 * k for k in range(len(lengths))]

    def content(server: int, at: int, n: int) -> bytes:
        step = 64 << 20  # a few items are larger than memory would like as one int64 range
        return b"".join(
            ((np.arange(lo, min(lo + step, at + n), dtype=np.uint64) + 7 * server) % 251).astype(np.uint8).tobytes()
            for lo in range(at, at + n, step)
        )

    with open(os.path.join(folder, f"file-{rank}"), "wb") as f:
        f.write(content(rank, 0, offsets[-1] + lengths[-1]))
    dist.barrier()
    segments = {r: [(f"file-{r}", at, n) for at, n in zip(offsets, lengths, strict=True)] for r in range(world)}
    places = [
        (name, at, memoryview(bytearray(n)))
        for r in range(world)
        if r != rank
        for name, at, n in segments[r]
        if n >= peers.ALONE_BYTES
    ]
    placed = {(name, at): torch.frombuffer(view, dtype=torch.uint8).data_ptr() for name, at, view in places}
    incoming = {r: peers._Stream(segments[r], Placements(places)) for r in range(world) if r != rank}
    peers.SENDING_BYTES = window
    peers._post(dist.group.WORLD, folder, {r: segments[rank] for r in range(world) if r != rank}, incoming)
    wrong = []
    for server, stream in incoming.items():
        for name, at, memory in stream.whole():
            if bytes(memory.numpy()) != content(server, at, len(memory)):
                wrong.append(f"{name} at {at}: other bytes")
            if len(memory) >= peers.ALONE_BYTES and memory.data_ptr() != placed[(name, at)]:
                wrong.append(f"{name} at {at}: not received into its place")
    return wrong
