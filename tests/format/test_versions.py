"""Every format version loads: checkpoints written by earlier releases, the header's fields."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.format.names import parse_data_file_name
from ckptio.format.records import Header, MeshRecord, SavedConfig
from ckptio.tools.cli import main as cli_main

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")


def _fixture_state() -> dict:
    """The state tests/data/v1-* were saved from, by ckptio 0.1.0 (commit c7ede4d), in one process."""
    torch.manual_seed(0)
    return {
        "w": (torch.randn(256, 130) * 8).round() / 8,
        "b": torch.arange(10, dtype=torch.bfloat16),
        "step": 7,
        "cfg": {"lr": 0.1, "name": "x"},
    }


@pytest.mark.parametrize("name", ["v1-raw", "v1-zstd"])
def test_checkpoints_written_by_0_1_0_load_bit_exact(name):
    assert_loads_the_v1_samples_state(os.path.join(DATA, name))


def assert_loads_the_v1_samples_state(path: str) -> None:
    """``path`` (a tests/data/v1-* sample, or a copy) loads exactly the state it was saved from."""
    expected = _fixture_state()
    state = {
        "w": torch.zeros(256, 130),
        "b": torch.zeros(10, dtype=torch.bfloat16),
        "step": 0,
        "cfg": {"lr": 0.0, "name": ""},
    }
    dcp.load(state, storage_reader=ckptio.Reader(path), planner=ckptio.SafeLoadPlanner())
    assert torch.equal(state["w"], expected["w"]) and torch.equal(state["b"], expected["b"])
    assert state["step"] == 7 and state["cfg"] == {"lr": 0.1, "name": "x"}


def _v2_sample_state(rank: int) -> dict:
    """The state tests/data/v2-sharded-zstd was saved from by ckptio at commit a4605a3 (format version 2),
    on 2 ranks: ``w`` as Shard(0) of a 2-rank mesh, compression zstd (``e`` in byte planes), 4 KiB blocks,
    a data file per rank, ``dl`` kept per rank."""
    torch.manual_seed(0)
    w = (torch.randn(256, 130) * 8).round() / 8
    e = torch.randn(64, 96).to(torch.bfloat16)
    return {"w": w, "e": e, "ids": torch.arange(3000), "step": 7, "dl": {"pos": 100 + rank}}


def _load_v2_sample(path: str) -> bool:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    state = {
        "w": distribute_tensor(torch.zeros(256, 130), mesh, [Shard(0)]),
        "e": torch.zeros(64, 96, dtype=torch.bfloat16),
        "ids": torch.zeros(3000, dtype=torch.int64),
        "step": 0,
        "dl": {"pos": 0},
    }
    ckptio.load(state, path)
    expected = _v2_sample_state(rank)
    return (
        torch.equal(state["w"].full_tensor(), expected["w"])
        and all(torch.equal(state[k], expected[k]) for k in ("e", "ids"))
        and (state["step"], state["dl"]) == (7, expected["dl"])
    )


def test_a_sharded_compressed_version_2_checkpoint_loads_bit_exact():
    from tests.helpers.harness import spawn

    path = os.path.join(DATA, "v2-sharded-zstd")
    assert spawn(2, _load_v2_sample, path) == [True, True]
    expected = _v2_sample_state(0)
    state = {"w": torch.zeros(256, 130), "e": torch.zeros(64, 96, dtype=torch.bfloat16), "step": 0}
    dcp.load(state, storage_reader=ckptio.Reader(path))  # resharded onto one process, per-rank keys left out
    assert torch.equal(state["w"], expected["w"]) and torch.equal(state["e"], expected["e"]) and state["step"] == 7
    assert cli_main(["verify", "-q", path]) == 0


def test_header_round_trips_and_keeps_the_version_1_keys():
    header = Header(
        files={"data-0123456789abcdef-r00003.ckio": 10},
        written_by="ckptio test",
        created_unix=1.5e9,
        save_id="0123456789abcdef",
        world_size=4,
        mesh=MeshRecord((2, 2), ("replicate", "shard")),
        config=SavedConfig("replica_group", "zstd", 1024),
        writer_ranks={"data-0123456789abcdef-r00003.ckio": 3},
    )
    doc = header.to_json()
    assert set(doc) == {
        "format", "format_version", "written_by", "torch_version", "created_unix", "save_id", "world_size",
        "mesh", "config", "files", "writer_ranks", "dcp_version",
    }  # fmt: skip
    assert doc["mesh"] == {"shape": [2, 2], "dims": ["replicate", "shard"]}
    assert Header.from_json(json.loads(json.dumps(doc)), "x", (header.files, header.writer_ranks)) == header
    assert parse_data_file_name("data-0123456789abcdef-r00003.ckio") == ("0123456789abcdef", 3, False)
    assert parse_data_file_name("data-0123456789abcdef-r00003.ckio\n") is None
