"""Rank bodies for saves without a coordinator (``dcp.save(..., use_collectives=False)``): an HSDP-shaped
state (replicated and sharded DTensors, a plain tensor, objects shared and per rank) saved on one mesh,
loaded on another, every value compared with the reference; and the collectives a save calls, counted
at torch's own functions."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckptio

SHAPES = {"model.w": ((640, 64), torch.float32), "model.e": ((40, 7, 3), torch.bfloat16)}
#: torch.distributed functions that exchange data; a save without a coordinator may only end in a barrier.
EXCHANGES = (
    "all_gather_object", "gather_object", "scatter_object_list", "broadcast_object_list", "all_gather", "gather",
    "scatter", "all_reduce", "reduce_scatter", "broadcast", "all_to_all", "send", "recv", "reduce",
)  # fmt: skip


def only_fragments(url: str, storage_options: dict | None = None) -> str:
    """``url`` as a job that died right after its save without a coordinator leaves it: its fragments,
    without the ``ckptio.json`` its rank 0 merges them into (``saving/merge_once.py``)."""
    from ckptio.storage import open_store

    ckptio.wait_for_uploads()  # this process's merges, when it saved
    store = open_store(url, storage_options)
    if store.exists("ckptio.json"):
        store.remove("ckptio.json")
    return url


def full(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {key: (torch.randn(shape, generator=g) * 10).to(dtype) for key, (shape, dtype) in SHAPES.items()}


def _placements(spec: list[tuple]) -> list:
    return [Shard(p[1]) if p[0] == "S" else Replicate() for p in spec]


def state(
    mesh_shape: list[int], placements: dict[str, list[tuple]], seed: int, zeros: bool = False, per_rank: bool = True
) -> dict[str, Any]:
    """The state on this rank: the DTensors of ``SHAPES`` (zeroed with ``zeros``), the step as a plain
    tensor, a shared object, this rank's own loader key and (``per_rank``) a per-rank value under one key."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    out: dict[str, Any] = {}
    for key, value in full(seed).items():
        value = torch.zeros_like(value) if zeros else value
        out[key] = distribute_tensor(value, mesh, _placements(placements[key]), src_data_rank=None)
    out["optim.step"] = torch.tensor(0.0 if zeros else float(seed))
    out["lr"] = -1.0 if zeros else 0.5
    out[f"loader.rank{rank}"] = {"position": -1 if zeros else 100 + rank}
    out["rng"] = {"seed": -1 if zeros else 1000 + (rank if per_rank else 0)}
    return out


@contextlib.contextmanager
def counted_exchanges() -> Iterator[dict[str, int]]:
    """How often each of torch's exchanging collectives is called inside the block."""
    counts: dict[str, int] = {}
    originals = {name: getattr(dist, name) for name in EXCHANGES if hasattr(dist, name)}

    def counting(name, fn):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def save(url: str, case: dict[str, Any], values: dict[str, Any] | None = None, planner: Any = None) -> dict[str, int]:
    """Save without collectives; the exchanges the save made."""
    config = ckptio.WriterConfig(
        mode=case.get("mode", "all_ranks"),
        compression=case.get("compression"),
        tuning=ckptio.Tuning(max_block_size=case.get("max_block_size", 1024)),
        key_prefix=case.get("key_prefix"),
        overwrite=case.get("overwrite", False),
    )
    if values is None:
        values = state(case["save_mesh"], case["save_placements"], case["seed"], per_rank=case.get("per_rank", True))
    writer = ckptio.Writer(url, config, storage_options=case.get("storage_options"))
    with counted_exchanges() as counts:
        if case.get("async"):
            dcp.async_save(values, storage_writer=writer, planner=planner, use_collectives=False).result()
        else:
            dcp.save(values, storage_writer=writer, planner=planner, use_collectives=False)
    ckptio.wait_for_uploads()  # rank 0's merge (a spawned rank ends without running atexit)
    return counts


def save_in_groups(root: str, asynchronous: bool = False) -> list[str]:
    """4 ranks as a 2x2 mesh ("group", "inner"): each inner group of 2 saves its own state to
    ``root/group-<g>`` without collectives over its own process group (``model.w`` sharded over the inner
    mesh, ``model.e`` replicated over all four ranks, a step, each rank's loader); the names there."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("group", "inner"))
    g = rank // 2
    values = {
        "model.w": distribute_tensor(full(g)["model.w"], mesh["inner"], [Shard(0)], src_data_rank=None),
        "model.e": distribute_tensor(full(0)["model.e"], mesh, [Replicate(), Replicate()], src_data_rank=None),
        "step": torch.tensor(float(g)),
        f"loader.rank{rank}": {"position": 100 + rank},
    }
    url = f"{root}/group-{g}"
    group = mesh.get_group("inner")
    if asynchronous:
        dcp.async_save(values, storage_writer=ckptio.Writer(url), process_group=group, use_collectives=False).result()
    else:
        dcp.save(values, storage_writer=ckptio.Writer(url), process_group=group, use_collectives=False)
    ckptio.wait_for_uploads()  # the group's rank 0 merges its fragments
    dist.barrier()
    return sorted(os.listdir(url))


def load_and_compare(url: str, case: dict[str, Any], through: str = "dcp") -> list[str]:
    """Load into a zeroed state of the load layout; the keys that came back wrong on this rank."""
    per_rank = case.get("per_rank", True)
    target = state(case["load_mesh"], case["load_placements"], case["seed"], zeros=True, per_rank=per_rank)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if per_rank and world != case["save_world"]:
        del target["rng"]  # one value per saving rank: no value of its own for a rank of another world
    target = {k: v for k, v in target.items() if not k.startswith("loader.") or rank < case["save_world"]}
    options = case.get("storage_options")
    if through == "dcp":
        dcp.load(
            target, storage_reader=ckptio.Reader(url, storage_options=options, dedup_reads=case.get("dedup", "auto"))
        )
    else:
        ckptio.load(target, url, storage_options=options)
    reference = state(case["load_mesh"], case["load_placements"], case["seed"], per_rank=per_rank)
    if dist.is_initialized():
        dist.barrier()  # rank 0 hosts the group's store: it must not leave while a rank still builds a mesh
    return wrong_keys(target, reference)


def wrong_keys(loaded: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """The keys of ``reference`` that ``loaded`` holds with another value (DTensors: this rank's shard)."""
    return [
        key
        for key, value in reference.items()
        if key in loaded
        and not (
            torch.equal(loaded[key].to_local(), value.to_local())
            if hasattr(value, "to_local")
            else torch.equal(loaded[key], value)
            if isinstance(value, torch.Tensor)
            else loaded[key] == value
        )
    ]


def save_twice(url: str, case: dict[str, Any]) -> list[str]:
    """Save without collectives, then again to the same path: the second save's outcome on this rank."""
    save(url, case)
    try:
        save(url, case)
        return ["ok"]
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException too, reported to the test
        error = ckptio.unwrap(exc)
        return [f"{type(error).__name__}: {error}"]


class _DyingPlanner(DefaultSavePlanner):
    """torch's planner, but the process of ``rank`` exits as its save begins writing."""

    def __init__(self, rank: int):
        super().__init__()
        self.dying_rank = rank

    def finish_plan(self, new_plan):
        if dist.get_rank() == self.dying_rank:
            os._exit(3)
        return super().finish_plan(new_plan)


def save_then_die_on_rank(run: str, case: dict[str, Any], dying_rank: int) -> str:
    """Save step-1 in full; step-2's save loses ``dying_rank`` before it writes anything, and the
    others finish their part (their closing barrier then fails without it)."""
    values = state(case["save_mesh"], case["save_placements"], case["seed"])
    save(f"{run}/step-1", case, values)
    dist.barrier()
    try:
        save(f"{run}/step-2", case, values, planner=_DyingPlanner(dying_rank))
    except BaseException as exc:  # noqa: BLE001 - the closing barrier, with a dead peer
        return type(exc).__name__
    return "ok"


def save_late(url: str, case: dict[str, Any], late: int, delay_s: float) -> str:
    """``save`` with rank ``late`` starting ``delay_s`` after the others (an overwrite's ranks replace their
    fragments in turn); the save id of the ``ckptio.json`` at ``url`` once every rank's merge has ended."""
    values = state(case["save_mesh"], case["save_placements"], case["seed"], per_rank=case.get("per_rank", True))
    if dist.get_rank() == late:  # after the mesh, whose making waits for every rank
        time.sleep(delay_s)
    save(url, case, values)
    dist.barrier()
    from ckptio.format.document import decode_metadata
    from ckptio.storage import open_store

    store = open_store(url)
    return decode_metadata(store.read("ckptio.json"), url).header.save_id
