"""Reader(dedup_reads=...): stored bytes that several ranks need are read once and shared over the
process group; bit-exact on every layout, and a failure on one rank is the same error on all."""

from __future__ import annotations

import os
from functools import partial

import pytest

from tests.helpers import models, scenarios
from tests.helpers.harness import spawn

LOADS = [(4, (2, 2)), (4, (4, 1)), (2, (1, 2))]


def _stored_data_bytes(options: dict, url: str) -> int:
    from tests.conftest import s3_objects

    return sum(size for key, size in s3_objects(options, url).items() if key.endswith(".ckio"))


@pytest.mark.slow
@pytest.mark.parametrize("mode,compression", [("replica_group", None), ("all_ranks", "zstd")], ids=["raw", "zstd"])
def test_s3_serves_each_stored_byte_once(s3_proxy, mode, compression):
    proxy, base, options = s3_proxy
    url = f"{base}/{mode}"
    spawn(4, partial(scenarios.save, compression=compression), url, (2, 2), mode, options)
    stored = _stored_data_bytes(options, url)
    proxy.reset()
    for procs, mesh in LOADS if compression is None else LOADS[1:2]:  # zstd: the replicas' case
        assert spawn(procs, scenarios.load_shared, url, mesh, options, True) == [[]] * procs
        served = sum(v for key, v in proxy.reset().get_bytes.items() if key.endswith(".ckio"))
        assert served <= 1.05 * stored, (mesh, served / stored)
    if compression:
        return  # the replicas' reads without sharing: once, on the raw checkpoint
    for dedup in (False, "auto"):  # "auto" does not share a load this small (it would save < 128 MiB)
        assert spawn(4, scenarios.load_shared, url, (4, 1), options, dedup) == [[]] * 4
        served = sum(v for key, v in proxy.reset().get_bytes.items() if key.endswith(".ckio"))
        assert served >= 3.9 * stored  # without sharing, each of the 4 replicas reads everything


def test_local_layouts_and_one_process(tmp_path):
    url = str(tmp_path / "ckpt")
    spawn(4, partial(scenarios.save, compression="zstd"), url, (2, 2), "all_ranks")
    for procs, mesh in LOADS:
        assert spawn(procs, scenarios.load_shared, url, mesh, None, True) == [[]] * procs, mesh
    assert spawn(0, scenarios.load_shared, url, None, None, True) == [[]]


def test_exchanged_bytes_land_in_the_destination_tensors(tmp_path):
    """Raw stored chunks that a rank loads whole are read and received straight into its tensors: the
    shared load's transient memory is what a plain load's is, not a copy of the exchanged bytes;
    values exact on the saved layout, on all replicas (4x1) and on a reshard (1x4: blocks at the
    shard edges are not whole in one tensor, and travel through buffers)."""
    url, size = str(tmp_path / "ckpt"), 32 << 20
    spawn(4, scenarios.bench_save, url, size, (2, 2), "all_ranks")
    plain = spawn(4, partial(scenarios.bench_load_growth, dedup_reads=False), url, size, (2, 2))
    for mesh in ((2, 2), (4, 1), (1, 4)):
        shared = spawn(4, partial(scenarios.bench_load_growth, dedup_reads=True), url, size, mesh)
        assert [bad for bad, _, _ in shared] == [[]] * 4, mesh
        if mesh != (1, 4):
            for (_, growth, needed), (_, baseline, _) in zip(shared, plain, strict=True):
                assert growth - baseline < needed // 8, (mesh, growth >> 20, baseline >> 20, needed >> 20)


@pytest.mark.slow
def test_fsdp_tp_strided_layouts(tmp_path):
    reference = str(tmp_path / "reference.pt")
    urls = []
    for mode in ("all_ranks", "replica_group"):
        urls.append(str(tmp_path / mode))
        spawn(4, models.save_trained, "dp_tp:2x2", urls[-1], mode, reference)
    bad = spawn(4, partial(models.load_into, reader={"dedup_reads": True}), ["dp_tp:2x2", "hsdp:2x2"], urls, reference)
    assert bad == [[]] * 4


def _corrupt(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_failed_read_is_the_same_error_on_every_rank(tmp_path):
    url = str(tmp_path / "ckpt")
    spawn(4, scenarios.save, url, (2, 2), "replica_group")
    (data,) = [n for n in sorted(os.listdir(url)) if n.endswith("-r00000.ckio")]
    _corrupt(os.path.join(url, data), 100)
    messages = spawn(4, scenarios.load_shared_error, url, (4, 1))
    assert all(m.startswith("CorruptCheckpointError: ") and "checksum mismatch for key" in m for m in messages)
    assert all(data in m for m in messages), messages  # the file, on the rank that read it and on the others
    os.truncate(os.path.join(url, data), 1000)
    messages = spawn(4, scenarios.load_shared_error, url, (2, 2))
    assert all(m.startswith("CorruptCheckpointError: ") and "is truncated" in m and data in m for m in messages)


def test_plan_reads_every_needed_block_once_by_a_rank_that_needs_it():
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from ckptio.format.names import Codec, ItemKind
    from ckptio.format.records import StoredItem
    from ckptio.loading.shared_reads import _sweep, plan_shared_reads

    assert _sweep([(0, 10, 0), (5, 15, 1), (12, 15, 2)]) == [
        (0, 5, frozenset({0})),
        (5, 10, frozenset({0, 1})),
        (10, 12, frozenset({1})),
        (12, 15, frozenset({1, 2})),
    ]
    items = {
        MetadataIndex(name): StoredItem(
            "f", at, 1000, ItemKind.TENSOR, "float32", (250,), Codec.RAW, 100, ((100, 0),) * 10
        )
        for name, at in (("a", 0), ("b", 1000), ("c", 2000))
    }
    needs = {
        MetadataIndex("a"): [(0, 10, frozenset({0, 1}))],
        MetadataIndex("b"): [(0, 5, frozenset({0})), (5, 10, frozenset({0, 1, 2}))],
        MetadataIndex("c"): [(0, 10, frozenset({1, 2}))],
    }
    plan = plan_shared_reads(needs, items.__getitem__, 3, budget=1500)
    assert [sorted({s.index.fqn for s in r}) for r in plan.rounds] == [["a"], ["b"], ["c"]]  # whole items per round
    read = [(s.index.fqn, b) for r in plan.rounds for s in r for b in range(s.first, s.last)]
    assert sorted(read) == sorted(
        (k.fqn, b) for k, runs in needs.items() for first, last, _ in runs for b in range(first, last)
    )
    for segment in (s for r in plan.rounds for s in r):
        assert segment.reader in segment.needers
        assert (segment.start, segment.end) == (
            items[segment.index].block_offsets[segment.first],
            items[segment.index].block_offsets[segment.last],
        )
    loads = [sum(s.size for r in plan.rounds for s in r if s.reader == rank) for rank in range(3)]
    assert loads == [1500, 500, 1000]  # a, b's own half -> 0; b's shared half -> 1 (least loaded); c -> 2


def test_auto_shares_remote_loads_that_save_enough_reads():
    from ckptio.loading.shared_reads import worth_sharing

    gib = 1 << 30
    assert worth_sharing(True, 2 * gib, gib)  # HSDP 2 replicas on S3
    assert worth_sharing(True, int(1.1 * 4 * gib), 4 * gib)  # a resharded load: straddling blocks, 400 MiB
    assert not worth_sharing(False, 4 * gib, gib)  # a local disk: the page cache wins
    assert not worth_sharing(True, 128 << 20, 64 << 20)  # too little to save for a round of collectives
    assert not worth_sharing(True, int(1.01 * 100 * gib), 100 * gib)  # next to nothing shared
