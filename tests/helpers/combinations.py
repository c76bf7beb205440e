"""Every feature with every other: the axes of a save, a covering array of their values, and the rank
bodies that save each row twice on 4 gloo ranks (a 2x2 HSDP mesh) and load it back.

A row is one combination: save mode, compression, ``dcp.save`` or ``dcp.async_save``, a node tier (its
files copied to the other node, or not) or none, incremental off / against "previous" / against the first
step named, with or without collectives, spread key prefixes or none, a local folder or S3, the default
process group or each replica group of the mesh saving its own checkpoint over its shard group. The state
is AdamW-shaped (frozen weights, moments that change every step), with objects and a value that differs
per rank."""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckptio

AXES: dict[str, tuple] = {
    "mode": ("all_ranks", "replica_group"),
    "compression": (None, "zstd"),
    "api": ("save", "async_save"),
    "tier": (None, "node", "copies"),
    "incremental": (None, "previous", "named"),
    "collectives": (True, False),
    "key_prefix": (None, "hash"),
    "target": ("local", "s3"),
    "group": ("default", "sub"),
}
SHAPES = {"model.w": (48, 40), "model.b": (37,), "optim.w.exp_avg": (48, 40), "optim.w.exp_avg_sq": (48, 40)}
FROZEN = ("model.w", "model.b")


def all_rows() -> list[dict[str, Any]]:
    """The full product of the axes' values."""
    return [dict(zip(AXES, values, strict=True)) for values in itertools.product(*AXES.values())]


def covering_rows() -> list[dict[str, Any]]:
    """Rows in which every pair of values of two axes meets at least once, starting with the twelve of
    tier x incremental (off, on) x collectives; rows picked greedily (most pairs still uncovered, first
    in the product's order on ties), so the array is the same on every run."""
    names = list(AXES)
    product = all_rows()

    def pairs(row: dict) -> set:
        return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}

    uncovered = set().union(*map(pairs, product))
    rows: list[dict[str, Any]] = []

    def take(candidates: list[dict]) -> None:
        best = max(candidates, key=lambda row: len(pairs(row) & uncovered))
        rows.append(best)
        uncovered.difference_update(pairs(best))

    for tier, incremental, collectives in itertools.product(AXES["tier"], (None, "previous"), (True, False)):
        wanted = {"tier": tier, "incremental": incremental, "collectives": collectives}
        if tier == "copies":  # over both nodes: a save over one replica group's ranks has no other node
            wanted["group"] = "default"
        take([row for row in product if all(row[k] == v for k, v in wanted.items())])
    while uncovered:
        take(product)
    return rows


def values(step: int) -> dict[str, torch.Tensor]:
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        value = torch.randn(shape, generator=torch.Generator().manual_seed(i))
        out[name] = value if name in FROZEN else value + step
    return out


def state(row: dict, step: int, zeros: bool = False, per_rank: bool = True, mesh_shape=(2, 2)) -> dict[str, Any]:
    """The state at ``step`` on ``mesh_shape`` (HSDP on 2x2; each replica group's shard mesh when the row
    saves over sub-groups; plain tensors with ``None``)."""
    mesh = _mesh(row, mesh_shape)
    out: dict[str, Any] = {}
    for name, value in values(step).items():
        value = torch.zeros_like(value) if zeros else value
        if mesh is not None:
            placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
            value = distribute_tensor(value, mesh, placements)
        out[name] = value
    out["optim.step"] = torch.tensor(-1 if zeros else step)
    out["extra"] = {"lr": None if zeros else 1e-3 * step, "name": None if zeros else "run"}
    if per_rank:
        out["rank_value"] = {"rank": None if zeros else dist.get_rank() if dist.is_initialized() else 0}
    return out


def problems(loaded: dict, step: int, row: dict) -> list[str]:
    want = state(row, step, per_rank=False, mesh_shape=None)
    bad = []
    for name, value in loaded.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        expected = want.get(name, {"rank": dist.get_rank() if dist.is_initialized() else 0})
        same = torch.equal(full, expected) if isinstance(full, torch.Tensor) else full == expected
        if not same:
            bad.append(name)
    return bad


def _mesh(row: dict, mesh_shape):
    if mesh_shape is None:
        return None
    if len(mesh_shape) == 1:
        return init_device_mesh("cpu", tuple(mesh_shape))
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("replicate", "shard"))
    return mesh["shard"] if row["group"] == "sub" else mesh


def url_of(root: str, row: dict, index: int, step: int, options: dict | None, group: int = 0) -> str:
    base = options["base"] if row["target"] == "s3" else root
    return f"{base}/row{index}{'-g%d' % group if row['group'] == 'sub' else ''}/step-{step}"


def save_and_load_rows(root: str, rows: list[dict], options: dict | None) -> list[list[str]]:
    """On each of 4 ranks: every row saved twice and its second step loaded on the same mesh; the
    problems of each row's load (empty: exact)."""
    rank = dist.get_rank()
    group = rank // 2
    os.environ["CKPTIO_NODE"] = f"node{group}"  # two ranks a node, each node its own fast tier
    storage = options["storage_options"] if options else None
    out = []
    for index, row in enumerate(rows):
        tier = os.path.join(root, "tiers", f"node{group}") if row["tier"] else None
        pg = _mesh(row, (2, 2)).get_group() if row["group"] == "sub" else None
        for step in (1, 2):
            url = url_of(root, row, index, step, options, group)
            base = row["incremental"]  # the first step records digests ("previous": another row's, so in full)
            if base == "named":
                base = url_of(root, row, index, 1, options, group) if step == 2 else "previous"
            config = ckptio.WriterConfig(
                mode=row["mode"],
                compression=row["compression"],
                local_tier=tier,
                local_tier_copies=2 if row["tier"] == "copies" else 1,
                incremental_from=base,
                key_prefix=row["key_prefix"],
                differing_objects="keep_per_rank",
                storage_config=ckptio.StorageConfig(read_gap_bytes=0),
                # a save without a coordinator keeps small items inline: never referenced
                tuning=ckptio.Tuning(max_block_size=1024, inline_limit=0),
            )
            writer = ckptio.Writer(url, config, storage_options=storage)
            kwargs = {"process_group": pg, "use_collectives": row["collectives"]}
            if row["api"] == "async_save":
                dcp.async_save(state(row, step), storage_writer=writer, **kwargs).result()
            else:
                dcp.save(state(row, step), storage_writer=writer, **kwargs)
            ckptio.wait_for_uploads()  # the drain and the merge: the next step's "previous" is committed
        loaded = state(row, 2, zeros=True, per_rank=row["group"] == "default")
        reader = ckptio.Reader(url_of(root, row, index, 2, options, group), storage_options=storage, local_tier=tier)
        dcp.load(loaded, storage_reader=reader, process_group=pg)
        out.append(problems(loaded, 2, row))
    return out


def load_rows(root: str, rows: list[dict], options: dict | None, mesh_shape) -> list[list[str]]:
    """Every row's second step (replica group 0's, saved over sub-groups) loaded on ``mesh_shape``
    (``None``: plain tensors, one process) from the durable tier alone."""
    storage = options["storage_options"] if options else None
    out = []
    for index, row in enumerate(rows):
        loaded = state({**row, "group": "default"}, 2, zeros=True, per_rank=False, mesh_shape=mesh_shape)
        url = url_of(root, row, index, 2, options)
        dcp.load(loaded, storage_reader=ckptio.Reader(url, storage_options=storage))
        out.append(problems(loaded, 2, row))
    return out
