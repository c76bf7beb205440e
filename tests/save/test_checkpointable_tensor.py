"""torch's ``CheckpointableTensor`` (torch >= 2.14: a plain local tensor that carries its global shape and
offsets, saved as a shard) through ``ckptio.Writer``: ``dcp.save`` and ``dcp.async_save`` with the Writer's
own staging (which must keep the fields on its copy, reused buffers included) and the THREAD executor; the
PROCESS executor hands tensors over in shared memory without their fields, which is refused by name."""

from __future__ import annotations

import pytest
import torch

from ckptio.torch_seam import CheckpointableTensor
from tests.helpers.harness import spawn

pytestmark = [
    pytest.mark.protocol,
    pytest.mark.skipif(CheckpointableTensor is None, reason="torch < 2.14 has no CheckpointableTensor"),
]

ROWS, COLS = 6, 5  # two ranks: rows 0-2 and 3-5


def _full() -> torch.Tensor:
    return torch.arange(float(ROWS * COLS)).reshape(ROWS, COLS)


def _shard(rank: int, source: torch.Tensor) -> torch.Tensor:
    half = ROWS // 2
    local = source[rank * half : (rank + 1) * half].clone()
    local.global_shape = (ROWS, COLS)
    local.global_offsets = ((rank * half, 0),)
    local.local_offsets = ((0, 0),)
    local.local_sizes = ((half, COLS),)
    return local


def _save_and_load(root: str, how: str) -> list[str]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import ckptio

    rank, problems = dist.get_rank(), []
    for step in range(2):  # the second async save reuses the first one's staging buffers
        source = _full() + 100 * step
        url = f"{root}/{how}-{step}"
        state = {"w": _shard(rank, source), "step": step}
        if how == "sync":
            dcp.save(state, storage_writer=ckptio.Writer(url))
        else:
            kind = AsyncCheckpointerType.PROCESS if how == "process" else AsyncCheckpointerType.THREAD
            dcp.async_save(state, storage_writer=ckptio.Writer(url), async_checkpointer_type=kind).result()
        target = {"w": _shard(rank, torch.zeros(ROWS, COLS)), "step": -1}
        dcp.load(target, storage_reader=ckptio.Reader(url))
        if not torch.equal(target["w"], _shard(rank, source)) or target["step"] != step:
            problems.append(f"{url}: rank {rank} loaded {target['w'].tolist()}")
    return problems


@pytest.mark.parametrize("how", ["sync", "thread"])
def test_checkpointable_tensors_save_as_shards_and_load_exact(tmp_path, how):
    import torch.distributed.checkpoint as dcp

    import ckptio

    assert spawn(2, _save_and_load, str(tmp_path), how) == [[], []]
    for step in range(2):  # one process reads the whole tensor the two ranks saved
        whole = {"w": torch.zeros(ROWS, COLS), "step": -1}
        dcp.load(whole, storage_reader=ckptio.Reader(str(tmp_path / f"{how}-{step}")))
        assert torch.equal(whole["w"], _full() + 100 * step)


def _async_save_in_a_process(root: str) -> str:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import ckptio

    state = {"w": _shard(dist.get_rank(), _full())}
    future = dcp.async_save(
        state, storage_writer=ckptio.Writer(f"{root}/process"), async_checkpointer_type=AsyncCheckpointerType.PROCESS
    )
    try:
        future.result()
    except Exception as exc:  # noqa: BLE001 - the refusal, as the caller's future reports it
        return str(exc)
    return "saved"


def test_the_process_executor_refuses_checkpointable_tensors_by_name(tmp_path):
    """Not PerRankStateError advising ckptio.PerRank (the misleading error before): the cause, the remedy."""
    import os

    outcomes = spawn(2, _async_save_in_a_process, str(tmp_path))
    assert all("CheckpointableTensors" in o and "AsyncCheckpointerType.THREAD" in o for o in outcomes), outcomes
    assert not os.path.exists(tmp_path / "process" / "ckptio.json")
