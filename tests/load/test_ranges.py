"""Which bytes a read needs (``ckptio.loading.ranges``): runs of a box, blocks of runs, merged requests."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.config import MAX_REQUEST_BYTES
from ckptio.loading.ranges import ReadPiece, blocks_for_runs, box_runs, plan_requests
from tests.conftest import S3_SERVERS


def test_box_runs_row_slices_are_one_run():
    assert box_runs([10, 8], [2, 0], [3, 8]) == [(16, 40)]
    assert box_runs([10, 8], [0, 0], [10, 8]) == [(0, 80)]
    assert box_runs([], [], []) == [(0, 1)]
    assert box_runs([4, 4], [0, 0], [0, 4]) == []


def test_box_runs_column_slices_match_a_reference():
    shape, off, length = [5, 6, 4], [1, 2, 1], [3, 2, 2]
    ref = torch.arange(120).reshape(shape)[1:4, 2:4, 1:3].flatten().tolist()
    got = [e for start, stop in box_runs(shape, off, length) for e in range(start, stop)]
    assert got == ref


def test_blocks_for_runs_and_request_merging():
    assert blocks_for_runs([(0, 256), (250, 300), (1024, 1025)], itemsize=4, block_size=1024) == [0, 1, 4]

    def spans(pieces, max_len, gap=0):
        pieces = [ReadPiece(name, start, memoryview(bytearray(end - start))) for name, start, end in pieces]
        return [(r.name, r.offset, r.offset + r.length) for r in plan_requests(pieces, max_len, gap)]

    assert spans([("f", 10, 20), ("f", 0, 10), ("g", 0, 5), ("f", 30, 40)], max_len=100) == [
        ("f", 0, 20),
        ("f", 30, 40),
        ("g", 0, 5),
    ]
    assert spans([("f", 0, 10), ("f", 10, 20)], max_len=15) == [("f", 0, 10), ("f", 10, 20)]
    assert spans([("f", 0, 10), ("f", 30, 40)], max_len=100, gap=20) == [("f", 0, 40)]  # the gap read and dropped
    assert spans([("f", 0, 40)], max_len=15) == [("f", 0, 15), ("f", 15, 30), ("f", 30, 40)]  # split


def test_one_request_policy_splits_long_reads_and_merges_touching_ones():
    big = memoryview(bytearray(100))
    a, b = memoryview(bytearray(10)), memoryview(bytearray(10))
    requests = plan_requests([ReadPiece("f", 0, big), ReadPiece("g", 10, b), ReadPiece("g", 0, a)], max_len=32)
    assert [(r.name, r.offset, r.length) for r in requests] == [
        ("f", 0, 32), ("f", 32, 32), ("f", 64, 32), ("f", 96, 4), ("g", 0, 20),
    ]  # fmt: skip
    assert requests[4].buffers[0].obj is a.obj and requests[4].buffers[1].obj is b.obj
    assert max(r.length for r in plan_requests([ReadPiece("f", 0, big)], max_len=100)) == 100


def test_reads_a_gap_apart_merge_when_the_gap_is_cheaper_than_a_request():
    def piece(name, offset, n):
        return ReadPiece(name, offset, memoryview(bytearray(n)))

    pieces = [piece("f", 0, 10), piece("f", 15, 5), piece("f", 40, 10), piece("f", 52, 8), piece("g", 61, 4)]
    plan = plan_requests(pieces, max_len=1000, gap=5)
    assert [(r.name, r.offset, r.length, len(r.buffers)) for r in plan] == [
        ("f", 0, 20, 3), ("f", 40, 20, 3), ("g", 61, 4, 1),
    ]  # fmt: skip
    assert plan[0].buffers[0].obj is pieces[0].buffer.obj and plan[0].buffers[2].obj is pieces[1].buffer.obj
    assert [len(b) for b in plan[0].buffers] == [10, 5, 5]  # the gap lands in a throwaway buffer
    # no bridge past the longest request, and none without a gap allowance
    assert [r.length for r in plan_requests(pieces, max_len=15, gap=5)] == [10, 5, 10, 8, 4]
    assert len(plan_requests(pieces, max_len=1000)) == 5


@pytest.mark.parametrize("s3", S3_SERVERS, indirect=True)
def test_a_large_tensor_is_fetched_in_capped_parallel_requests(s3_proxy):
    proxy, base, options = s3_proxy
    url = f"{base}/big"
    tensor = torch.arange((2 * MAX_REQUEST_BYTES + (4 << 20)) // 4, dtype=torch.float32)
    dcp.save({"t": tensor}, storage_writer=ckptio.Writer(url, storage_options=options))
    proxy.reset()
    out = {"t": torch.zeros_like(tensor)}
    dcp.load(out, storage_reader=ckptio.Reader(url, storage_options=options))
    stats = proxy.reset()
    assert torch.equal(out["t"], tensor)
    assert stats.requests["GET"] == 1 + 3  # ckptio.json, then 32 + 32 + 4 MiB
    (name,) = [k for k in stats.get_bytes if k.endswith(".ckio")]
    assert stats.get_bytes[name] == tensor.numel() * 4
