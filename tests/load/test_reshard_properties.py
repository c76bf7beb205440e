"""Property: any sub-box of any saved chunk grid loads exactly what slicing the full tensor gives.

One process saves a tensor as a random grid of chunks (through DCP's planner interface, the way a
sharded rank would describe them), with random block sizes, dtypes and codecs, and loads random
boxes of it, each a DCP read item per saved chunk it meets, with random read-gap settings. The
reference is ``full[box]``. Shapes are chosen so that boxes cut blocks at every kind of place:
inside a row, across rows, skipping whole blocks between rows (the class of issue 34's item 0).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

import ckptio
from ckptio.config import StorageConfig
from ckptio.format.records import Extent
from ckptio.loading.reader import read_manifest
from ckptio.storage import open_store

#: Also run against the newest torch on disk (make test-torch-newest).
pytestmark = pytest.mark.protocol

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.int16, torch.uint8]
Box = tuple[tuple[int, ...], tuple[int, ...]]


class ChunkGridSavePlanner(DefaultSavePlanner):
    """Saves tensor ``t`` as the given chunks (what a sharded rank's plan holds), everything else as usual."""

    def __init__(self, chunks: list[Box]):
        super().__init__()
        self.chunks = chunks

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        full = self.state_dict["t"]
        props = TensorProperties.create_from_tensor(full)
        items = [i for i in plan.items if i.index.fqn != "t"]
        for offsets, sizes in self.chunks:
            items.append(
                WriteItem(
                    index=MetadataIndex("t", torch.Size(offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                        properties=props,
                        size=full.size(),
                    ),
                )
            )
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.index.fqn != "t":
            return super().resolve_data(write_item)
        return _narrow(self.state_dict["t"], write_item.tensor_data.chunk.offsets, write_item.tensor_data.chunk.sizes)


class BoxLoadPlanner(DefaultLoadPlanner):
    """Loads boxes of tensor ``t`` into ``targets`` (one tensor per box): a read item for every saved
    chunk a box meets, as DCP's resharding makes them."""

    def __init__(self, boxes: list[Box], targets: list[torch.Tensor]):
        super().__init__()
        self.boxes, self.targets = boxes, targets

    def create_local_plan(self) -> LoadPlan:
        chunks = self.metadata.state_dict_metadata["t"].chunks
        items = []
        for k, (offsets, sizes) in enumerate(self.boxes):
            for chunk in chunks:
                lo = [max(a, b) for a, b in zip(offsets, chunk.offsets, strict=True)]
                hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, chunk.offsets, chunk.sizes, strict=True)]
                if any(h <= low for low, h in zip(lo, hi, strict=True)):
                    continue  # no element in common (an empty box meets no chunk)
                lengths = [h - low for low, h in zip(lo, hi, strict=True)]
                items.append(
                    ReadItem(
                        type=LoadItemType.TENSOR,
                        dest_index=MetadataIndex(f"box{k}"),
                        dest_offsets=torch.Size(a - o for a, o in zip(lo, offsets, strict=True)),
                        storage_index=MetadataIndex("t", chunk.offsets),
                        storage_offsets=torch.Size(a - o for a, o in zip(lo, chunk.offsets, strict=True)),
                        lengths=torch.Size(lengths),
                    )
                )
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self.targets[int(read_item.dest_index.fqn[3:])]
        return _narrow(target, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _narrow(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
        t = t.narrow(dim, o, n)
    return t


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(*box, strict=True))


@st.composite
def shard_box(draw, shape: list[int]) -> Box:
    """A box as a resharded rank asks for it: a shard of a 1-D or 2-D split along any dimensions (a
    column shard of row-sharded chunks is the FSDP <-> TP change), or any box at all."""
    if draw(st.integers(0, 3)):
        offsets, sizes = [0] * len(shape), list(shape)
        for dim in draw(st.sets(st.integers(0, len(shape) - 1), min_size=1, max_size=2)):
            parts = draw(st.integers(1, 4))
            step = -(-shape[dim] // parts)  # torch's Shard: ceil-sized pieces, the last ones short or empty
            at = min(shape[dim], draw(st.integers(0, parts - 1)) * step)
            offsets[dim], sizes[dim] = at, min(step, shape[dim] - at)
        return tuple(offsets), tuple(sizes)
    offsets, sizes = [], []
    for n in shape:
        a = draw(st.integers(0, n))
        offsets.append(a)
        sizes.append(draw(st.integers(a, n)) - a)
    return tuple(offsets), tuple(sizes)


@st.composite
def cases(draw):
    ndim = draw(st.sampled_from([1, 2, 2, 3]))
    # A last dimension long enough to span several blocks of the smaller block sizes.
    shape = [draw(st.integers(1, 12)) for _ in range(ndim - 1)]
    shape.append(draw(st.one_of(st.integers(1, 64), st.integers(256, 1500))))
    dtype = draw(st.sampled_from(DTYPES))
    # A grid: each dimension cut at random places (an FSDP row split, a TP column split, or both).
    cuts = [sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=3))) if n > 1 else [] for n in shape]
    edges = [[0, *c, n] for c, n in zip(cuts, shape, strict=True)]
    chunks: list[Box] = [((), ())]
    for e in edges:
        chunks = [(o + (a,), s + (b - a,)) for o, s in chunks for a, b in zip(e, e[1:], strict=False)]
    boxes = [draw(shard_box(shape)) for _ in range(draw(st.integers(1, 3)))]
    return {
        "shape": shape,
        "dtype": dtype,
        "chunks": chunks,
        "boxes": boxes,
        "max_block_size": draw(st.sampled_from([64, 128, 192, 320, 1024, 4096])),
        "compression": draw(st.sampled_from([None, "zstd"])),
        "compressible": draw(st.booleans()),
        "read_gap_bytes": draw(st.sampled_from([None, 0, 64, 1000, 8 << 20])),
        "seed": draw(st.integers(0, 2**16)),
    }


@st.composite
def transposed_cases(draw):
    """Saved as shards of one dimension, loaded as shards of another (FSDP <-> TP): every box cuts
    every chunk's rows, so the blocks it needs are spread through the chunk with gaps between."""
    case = draw(cases())
    shape = case["shape"] = [draw(st.integers(2, 12)), *case["shape"][-2:-1], draw(st.integers(200, 1500))]
    case["max_block_size"] = draw(st.sampled_from([64, 128, 192, 320, 1024]))  # blocks shorter than a row
    saved, loaded = draw(st.permutations(range(len(shape))))[:2]
    saved_parts = draw(st.integers(1, 4))
    chunks = [_shard(shape, saved, k, saved_parts) for k in range(saved_parts)]
    case["chunks"] = [c for i, c in enumerate(chunks) if c not in chunks[:i]]  # empty tail shards coincide
    parts = draw(st.integers(2, 4))
    case["boxes"] = [_shard(shape, loaded, k, parts) for k in range(parts)]
    return case


def _shard(shape: list[int], dim: int, k: int, parts: int) -> Box:
    """Piece ``k`` of ``parts`` of ``shape`` along ``dim``, as torch's ``Shard(dim)`` cuts it."""
    step = -(-shape[dim] // parts)
    at = min(shape[dim], k * step)
    offsets, sizes = [0] * len(shape), list(shape)
    offsets[dim], sizes[dim] = at, min(step, shape[dim] - at)
    return tuple(offsets), tuple(sizes)


def full_tensor(case) -> torch.Tensor:
    g = torch.Generator().manual_seed(case["seed"])
    shape, dtype = case["shape"], case["dtype"]
    if case["compressible"]:  # few distinct values: zstd shrinks the blocks, so they are stored compressed
        return torch.randint(0, 4, shape, generator=g).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def save_and_load_boxes(case, url: str, storage_options: dict | None = None) -> None:
    full = full_tensor(case)
    config = ckptio.WriterConfig(
        compression=case["compression"], tuning=ckptio.Tuning(max_block_size=case["max_block_size"])
    )
    dcp.save(
        {"t": full, "step": 3},
        storage_writer=ckptio.Writer(url, config, storage_options=storage_options),
        planner=ChunkGridSavePlanner(case["chunks"]),
        no_dist=True,
    )
    targets = [torch.full(sizes, 7, dtype=full.dtype) for _, sizes in case["boxes"]]
    reader = ckptio.Reader(
        url, storage_options=storage_options, storage_config=StorageConfig(read_gap_bytes=case["read_gap_bytes"])
    )
    dcp.load({"t": torch.empty(0)}, storage_reader=reader, planner=BoxLoadPlanner(case["boxes"], targets), no_dist=True)
    for box, target in zip(case["boxes"], targets, strict=True):
        expected = full[_slices(box)]
        assert torch.equal(target, expected), f"box {box} of {case['shape']} {case['dtype']} differs: {case}"


PROPERTY_EXAMPLES = int(os.environ.get("CKPTIO_PROPERTY_EXAMPLES", 100))
PROPERTIES = {"grid": cases(), "transposed": transposed_cases()}


def _check_local(kind: str, tmp_path, examples: int) -> None:
    @settings(max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=PROPERTIES[kind])
    def run(case):
        with tempfile.TemporaryDirectory(dir=tmp_path) as d:
            save_and_load_boxes(case, os.path.join(d, "ckpt"))

    run()


@pytest.mark.parametrize("kind", list(PROPERTIES))
def test_any_box_of_any_chunk_grid_loads_exactly_local(kind, tmp_path):
    _check_local(kind, tmp_path, PROPERTY_EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(PROPERTIES))
def test_any_box_of_any_chunk_grid_loads_exactly_local_many(kind, tmp_path):
    _check_local(kind, tmp_path, PROPERTY_EXAMPLES * 6)


def test_any_box_of_any_chunk_grid_loads_exactly_s3(moto_server):
    """The same properties over HTTP ranged reads (read gaps bridged remotely), fewer examples."""
    from tests.conftest import s3_client

    options = {"client_kwargs": {"endpoint_url": moto_server}, "key": "testing", "secret": "testing"}
    s3_client(options).create_bucket(Bucket="ckptio-box-properties")
    counter = iter(range(10**9))

    @settings(max_examples=max(10, PROPERTY_EXAMPLES // 4), database=None, deadline=None)
    @given(case=st.one_of(*PROPERTIES.values()))
    def run(case):
        save_and_load_boxes(case, f"s3://ckptio-box-properties/c{next(counter)}", options)

    run()


@st.composite
def safetensors_cases(draw):
    """One tensor stored whole in a safetensors file (beside others, so reads start mid-file), any
    boxes of it, any read gap."""
    case = draw(st.one_of(cases(), transposed_cases()))
    case["dtype"] = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.float64]))
    case["chunks"] = [((0,) * len(case["shape"]), tuple(case["shape"]))]
    return case


def test_any_box_of_a_safetensors_tensor_loads_exactly(tmp_path):
    """The same property for HFReader's box reads (safetensors: no blocks, a tensor's raw row-major
    bytes read run by run or as one span, by read gap)."""
    from safetensors.torch import save_file

    counter = iter(range(10**9))

    @settings(max_examples=PROPERTY_EXAMPLES, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=safetensors_cases())
    def run(case):
        folder = tmp_path / f"hf{next(counter)}"
        folder.mkdir()
        full = full_tensor(case)
        save_file(
            {"a.before": torch.arange(7, dtype=torch.int16), "t": full, "z.after": torch.ones(3)},
            folder / "model.safetensors",
        )
        targets = [torch.full(sizes, 7, dtype=full.dtype) for _, sizes in case["boxes"]]
        reader = ckptio.HFReader(
            folder, storage_config=ckptio.StorageConfig(read_gap_bytes=case["read_gap_bytes"] or 0)
        )
        dcp.load(
            {"t": torch.empty(0)}, storage_reader=reader, planner=BoxLoadPlanner(case["boxes"], targets), no_dist=True
        )
        for box, target in zip(case["boxes"], targets, strict=True):
            assert torch.equal(target, full[_slices(box)]), f"box {box} of {case['shape']} {case['dtype']} differs"

    run()


@st.composite
def incremental_cases(draw):
    """A grid saved once with digests, some of its chunks changed, saved again against the first save
    (each with its own codec), any boxes of the second loaded."""
    case = draw(st.one_of(cases(), transposed_cases()))
    case["base_compression"] = draw(st.sampled_from([None, "zstd"]))
    case["changed"] = draw(st.sets(st.integers(0, len(case["chunks"]) - 1)))  # every element of these chunks
    numel = 1
    for n in case["shape"]:
        numel *= n
    case["touched"] = draw(st.lists(st.integers(0, max(0, numel - 1)), max_size=4))  # a few elements anywhere
    case["inline_limit"] = draw(st.sampled_from([0, 64 << 10]))  # a small state is kept inline: not referenced
    # what the save takes a read request to cost: None, the store's (these small chunks are then written
    # whole where they changed at all); 0, nothing (every unchanged block referenced: chunks in pieces)
    case["request_cost"] = draw(st.sampled_from([0, None, 256]))
    return case


def save_incrementally_and_load_boxes(case, run: str) -> None:
    full = full_tensor(case)
    planner = ChunkGridSavePlanner(case["chunks"])
    base = ckptio.WriterConfig(
        compression=case["base_compression"],
        incremental_from="previous",
        tuning=ckptio.Tuning(max_block_size=case["max_block_size"], inline_limit=case["inline_limit"]),
    )
    dcp.save({"t": full, "step": 3}, storage_writer=ckptio.Writer(f"{run}/base", base), planner=planner, no_dist=True)
    changed = full.clone()
    for k in case["changed"]:
        region = _narrow(changed, *case["chunks"][k])
        region.copy_(region + 1)  # wraps for the integer dtypes: still a change
    flat = changed.view(-1)
    for i in case["touched"] if flat.numel() else ():
        flat[i] = flat[i] + 1
    config = dataclasses.replace(
        base,
        compression=case["compression"],
        incremental_from=f"{run}/base",
        storage_config=ckptio.StorageConfig(read_gap_bytes=case["request_cost"]),
    )
    dcp.save(
        {"t": changed, "step": 4},
        storage_writer=ckptio.Writer(f"{run}/next", config),
        planner=ChunkGridSavePlanner(case["chunks"]),
        no_dist=True,
    )
    manifest = read_manifest(open_store(f"{run}/next"))
    for k, (offsets, sizes) in enumerate(case["chunks"]):
        if 0 in sizes:
            continue  # no blocks: nothing to reference
        item = manifest.items[MetadataIndex("t", torch.Size(offsets))]
        runs = manifest.extents.get(item.file) or [Extent(item.file, item.offset, item.stored_bytes)]
        in_base = [run.file.startswith("../") for run in runs]
        if not (k in case["changed"] or _touches(case, offsets, sizes)):
            assert all(in_base) or case["inline_limit"], (k, runs, case)  # unchanged: every block referenced
        elif k in case["changed"]:
            assert not any(in_base), (k, runs, case)  # every element changed: every block written
        elif case["request_cost"] == 0 and not case["inline_limit"] and len(item.blocks) > len(case["touched"]):
            assert any(in_base) and not all(in_base), (k, runs, case)  # some blocks changed: in pieces
    targets = [torch.full(sizes, 7, dtype=full.dtype) for _, sizes in case["boxes"]]
    reader = ckptio.Reader(f"{run}/next", storage_config=StorageConfig(read_gap_bytes=case["read_gap_bytes"]))
    dcp.load({"t": torch.empty(0)}, storage_reader=reader, planner=BoxLoadPlanner(case["boxes"], targets), no_dist=True)
    for box, target in zip(case["boxes"], targets, strict=True):
        assert torch.equal(target, changed[_slices(box)]), f"box {box} of {case['shape']} {case['dtype']}: {case}"


def _touches(case, offsets, sizes) -> bool:
    """Whether an element ``case["touched"]`` changed lies in the chunk at ``offsets`` of ``sizes``."""
    for i in case["touched"]:
        position = []
        for n in reversed(case["shape"]):
            position.append(i % n)
            i //= n
        if all(o <= p < o + s for o, s, p in zip(offsets, sizes, reversed(position), strict=True)):
            return True
    return False


def test_any_box_of_an_incremental_save_of_any_grid_loads_exactly(tmp_path):
    """The grid and transposed properties for a checkpoint whose unchanged blocks are references into its
    base (a base and a save of different codecs; whole chunks changed, and single elements anywhere: a
    chunk in pieces, some blocks in the base's file and some in its own, where requests cost nothing;
    every unchanged chunk referenced whole, no wholly changed one)."""

    examples = PROPERTY_EXAMPLES // 2
    in_pieces = {  # one chunk of 16 blocks, one element changed, requests free: drawn rarely, so always run
        "shape": [256], "dtype": torch.float32, "chunks": [((0,), (256,))], "boxes": [((0,), (256,)), ((60,), (9,))],
        "max_block_size": 64, "compression": None, "compressible": False, "read_gap_bytes": None, "seed": 0,
        "base_compression": None, "changed": set(), "touched": [70], "inline_limit": 0, "request_cost": 0,
    }  # fmt: skip

    @settings(max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=incremental_cases())
    @example(case=in_pieces)
    def run(case):
        with tempfile.TemporaryDirectory(dir=tmp_path) as d:
            save_incrementally_and_load_boxes(case, d)

    run()
