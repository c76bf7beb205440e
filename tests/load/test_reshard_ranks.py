"""Property: DTensors saved on any mesh and placement (1, 2 or 4 gloo ranks; 1-D and 2x2 meshes; Shard
of any dimension, Replicate, two shards of one dimension) load exactly on any other, through plain
``dcp.save``/``dcp.load`` with ckptio's Writer and Reader, raw and zstd, any block size, shared reads
on and off, saved with a coordinator or without (``use_collectives=False``: each rank's fragment).
Each example runs on spawned ranks, so CI draws a few and the slow marker more; a failing example is
printed by hypothesis with the case that reproduces it."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

from tests.helpers import reshard_ranks
from tests.helpers.rank_properties import RANK_PROPERTY_EXAMPLES, save_then_compare, save_then_compare_drawn

#: Also run against the newest torch on disk (make test-torch-newest).
pytestmark = pytest.mark.protocol

MESHES = {1: [(1,)], 2: [(2,)], 4: [(4,), (2, 2)]}


@st.composite
def layouts(draw, ndims: list[int]):
    world = draw(st.sampled_from([1, 2, 4]))
    mesh = draw(st.sampled_from(MESHES[world]))
    specs = []
    for ndim in ndims:
        choice = st.one_of(st.just(("R",)), st.tuples(st.just("S"), st.integers(0, ndim - 1)))
        specs.append([draw(choice) for _ in mesh])
    return world, list(mesh), specs


@st.composite
def cases(draw):
    tensors = []
    for _ in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(1, 3))
        shape = [draw(st.integers(1, 9)) for _ in range(ndim - 1)] + [draw(st.integers(1, 700))]
        tensors.append((draw(st.permutations(shape)), draw(st.sampled_from(["float32", "bfloat16", "int16"]))))
    ndims = [len(shape) for shape, _ in tensors]
    save_world, save_mesh, save_placements = draw(layouts(ndims))
    load_world, load_mesh, load_placements = draw(layouts(ndims))
    return {
        "tensors": tensors,
        "save_world": save_world,
        "save_mesh": save_mesh,
        "save_placements": save_placements,
        "load_world": load_world,
        "load_mesh": load_mesh,
        "load_placements": load_placements,
        "mode": draw(st.sampled_from(["all_ranks", "replica_group"])),
        "compression": draw(st.sampled_from([None, "zstd"])),
        "max_block_size": draw(st.sampled_from([64, 256, 4096, 256 << 10])),
        "dedup_reads": draw(st.sampled_from([False, True, "auto"])),
        "key_prefix": draw(st.sampled_from([None, "hash"])),
        "collectives": draw(st.booleans()),  # False: a save without a coordinator, merged on load
        "seed": draw(st.integers(0, 2**16)),
    }


def test_any_saved_layout_loads_exactly_on_any_other(tmp_path_factory):
    save_then_compare_drawn(cases(), reshard_ranks, tmp_path_factory, RANK_PROPERTY_EXAMPLES)


@pytest.mark.slow
def test_any_saved_layout_loads_exactly_on_any_other_many(tmp_path_factory):
    save_then_compare_drawn(cases(), reshard_ranks, tmp_path_factory, RANK_PROPERTY_EXAMPLES * 5)


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_shards_load_as_column_shards_on_the_same_ranks(tmp_path, compression, dtype):
    """Issue 34's report, as a user met it: 16x5120 saved as Shard(0) on 2 ranks, loaded as Shard(1)."""
    case = {
        "tensors": [([16, 5120], dtype)],
        "save_world": 2,
        "save_mesh": [2],
        "save_placements": [[("S", 0)]],
        "load_world": 2,
        "load_mesh": [2],
        "load_placements": [[("S", 1)]],
        "mode": "all_ranks",
        "compression": compression,
        "max_block_size": 256 << 10,
        "dedup_reads": False,
        "seed": 0,
    }
    save_then_compare(reshard_ranks, case, str(tmp_path / "ckpt"))
