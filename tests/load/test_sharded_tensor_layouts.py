"""Property: legacy ``ShardedTensor`` layouts (``EnumerableShardingSpec``: any pieces along one dimension,
a rank holding several of one tensor, not adjacent, or none) saved on 1, 2 or 3 gloo ranks load exactly
into any other such layout or into a plain tensor, and a plain tensor into any layout, through plain
``dcp.save``/``dcp.load`` with ckptio's Writer and Reader; both modes, raw and zstd, any block size, saved
with a coordinator or without (a rank's fragment then lists several chunks of one key: the record merge's
case, which the column merge hands over). torch's own DCP tests save these shapes
(test_file_system_checkpoint_cpu.py); ours had none."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import strategies as st

from tests.helpers import sharded_tensor_ranks
from tests.helpers.rank_properties import RANK_PROPERTY_EXAMPLES, save_then_compare, save_then_compare_drawn

pytestmark = pytest.mark.protocol


@st.composite
def layouts(draw, shape: list[int], world: int):
    if draw(st.integers(0, 3)) == 0:
        return {"kind": "plain"}
    dim = draw(st.integers(0, len(shape) - 1))
    cuts = sorted(draw(st.sets(st.integers(1, shape[dim] - 1), max_size=5))) if shape[dim] > 1 else []
    bounds = [0, *cuts, shape[dim]]
    pieces = [(a, b - a, draw(st.integers(0, world - 1))) for a, b in itertools.pairwise(bounds)]
    return {"kind": "sharded", "dim": dim, "pieces": pieces}


@st.composite
def cases(draw):
    save_world, load_world = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    tensors = []
    for _ in range(draw(st.integers(1, 2))):
        shape = [draw(st.integers(1, 24)) for _ in range(draw(st.integers(1, 2)))]
        tensors.append(
            {
                "shape": shape,
                "dtype": draw(st.sampled_from(["float32", "bfloat16", "int16"])),
                "save": draw(layouts(shape, save_world)),
                "load": draw(layouts(shape, load_world)),
            }
        )
    return {
        "tensors": tensors,
        "save_world": save_world,
        "load_world": load_world,
        "mode": draw(st.sampled_from(["all_ranks", "replica_group"])),
        "compression": draw(st.sampled_from([None, "zstd"])),
        "max_block_size": draw(st.sampled_from([64, 256, 256 << 10])),
        "collectives": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def test_any_sharded_tensor_layout_loads_exactly_into_any_other(tmp_path_factory):
    # 180 drawn when written: all exact
    save_then_compare_drawn(cases(), sharded_tensor_ranks, tmp_path_factory, RANK_PROPERTY_EXAMPLES)


@pytest.mark.parametrize("collectives", [True, False])
def test_a_rank_holding_two_pieces_of_one_tensor_apart(tmp_path, collectives):
    """The layout of torch's own test: rows 0-1, 3-5 and 9 on rank 0, rows 2 and 6-8 on rank 1; loaded whole."""
    pieces = [(0, 2, 0), (2, 1, 1), (3, 3, 0), (6, 3, 1), (9, 1, 0)]
    case = {
        "tensors": [
            {"shape": [10, 20], "dtype": "float32", "save": {"kind": "sharded", "dim": 0, "pieces": pieces},
             "load": {"kind": "plain"}},
        ],
        "save_world": 2, "load_world": 2, "mode": "all_ranks", "compression": None,
        "max_block_size": 256 << 10, "collectives": collectives, "seed": 1,
    }  # fmt: skip
    save_then_compare(sharded_tensor_ranks, case, str(tmp_path / "ckpt"))
