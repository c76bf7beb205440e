"""At the sizes real jobs have: thousands of tensors per rank, items above 2 GiB, and reads that
merge more pieces than one system call takes (IOV_MAX, 1024 on Linux); raw and compressed,
local, memory:// and S3, whole and resharded, through plain ``dcp.load`` and ``ckptio.load``."""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.loading.reader import read_manifest
from ckptio.storage import ReadRequest, open_store
from ckptio.storage.local import IOV_MAX, MAX_SYSCALL_BYTES, syscall_batch
from tests.helpers.harness import spawn

#: Tensors per state: their reads merge into one request of this many pieces, about 3x IOV_MAX.
MANY = 3000
#: Elements of the large items: 2 GiB of fp32 and a row more, so offsets pass 2^31.
BIG_ROWS, BIG_COLS = (1 << 15) + 1, 1 << 14


def many_tensors(count: int = MANY) -> dict[str, torch.Tensor]:
    """An optimizer-state-like dict: norms and biases of several dtypes and sizes, 0-d steps."""
    state = {}
    for i in range(count):
        kind = i % 3
        if kind == 0:
            state[f"layers.{i}.norm.weight"] = torch.arange(64 + i % 7, dtype=torch.float32) * (i + 1)
        elif kind == 1:
            state[f"layers.{i}.bias"] = (torch.arange(32 + i % 5, dtype=torch.float32) - i).to(torch.bfloat16)
        else:
            state[f"layers.{i}.step"] = torch.tensor(float(i))
    return state


def zeros_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def assert_bit_exact(loaded: dict, expected: dict) -> None:
    bad = [k for k in expected if not torch.equal(_bits(loaded[k]), _bits(expected[k]))]
    assert not bad, f"{len(bad)} keys differ, e.g. {bad[:3]}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def load_with(api: str, state: dict, url: str, options: dict | None) -> None:
    if api == "ckptio":
        ckptio.load(state, url, storage_options=options)
    else:
        dcp.load(state, storage_reader=ckptio.Reader(url, storage_options=options))


def config(codec: str) -> ckptio.WriterConfig:
    return ckptio.WriterConfig(compression=None if codec == "raw" else "zstd")


# --- the limits themselves -------------------------------------------------------------


def test_syscall_batch_stays_within_iov_max_and_the_byte_cap():
    small = [memoryview(bytearray(3)) for _ in range(IOV_MAX * 3 + 5)]
    assert len(syscall_batch(small)) == IOV_MAX
    huge = memoryview(np.empty(MAX_SYSCALL_BYTES + 10, dtype=np.uint8))  # never touched: no memory used
    batch = syscall_batch([memoryview(bytearray(10)), huge, memoryview(bytearray(5))])
    assert [len(b) for b in batch] == [10, MAX_SYSCALL_BYTES - 10]


def test_one_read_of_many_more_pieces_than_iov_max(tmp_path):
    data = os.urandom(IOV_MAX * 5 * 7 + 11)
    (tmp_path / "f").write_bytes(data)
    store = open_store(str(tmp_path))
    pieces = [memoryview(bytearray(7)) for _ in range(IOV_MAX * 5)] + [
        memoryview(bytearray(0)),
        memoryview(bytearray(11)),
    ]
    assert store.read_into([ReadRequest("f", 0, tuple(pieces))]) == [len(data)]
    assert b"".join(bytes(p) for p in pieces) == data


# --- thousands of tensors ---------------------------------------------------------------


# Every pair of (api, store, codec) values, in half the runs of all eight combinations.
@pytest.mark.parametrize(
    ("api", "where", "codec"),
    [("ckptio", "local", "raw"), ("ckptio", "memory", "zstd"), ("dcp", "local", "zstd"), ("dcp", "memory", "raw")],
)
def test_thousands_of_small_tensors_load_bit_exact(tmp_path, codec, where, api):
    state = many_tensors()
    url = str(tmp_path / "ckpt") if where == "local" else f"memory://sizes-{uuid.uuid4().hex}"
    if api == "ckptio":
        ckptio.save(state, url, config(codec))
    else:
        dcp.save(state, storage_writer=ckptio.Writer(url, config(codec)))
    loaded = zeros_like_state(state)
    load_with(api, loaded, url, None)
    assert_bit_exact(loaded, state)


def test_thousands_of_small_tensors_saved_incrementally_load_bit_exact(tmp_path):
    """The default incremental call on an optimizer-like state of 3,000 tensors whose step counters (a
    third) changed: those are written, the other 2,000 referenced whole in the base's file; it loads
    bit-exact through dcp.load, and so does the base."""
    run = tmp_path / "run"
    state = many_tensors()
    config = ckptio.WriterConfig(incremental_from="previous")
    dcp.save(state, storage_writer=ckptio.Writer(str(run / "step-1"), config))
    base = {k: v.clone() for k, v in state.items()}
    steps = [k for k in state if k.endswith(".step")]
    for key in steps:
        state[key] += 1
    dcp.save(state, storage_writer=ckptio.Writer(str(run / "step-2"), config))
    manifest = read_manifest(open_store(str(run / "step-2")))
    in_base = {index.fqn for index, item in manifest.items.items() if item.file.startswith("../step-1/")}
    assert in_base == set(state) - set(steps) and len(in_base) == 2000
    for url, expected in ((run / "step-2", state), (run / "step-1", base)):
        loaded = zeros_like_state(expected)
        dcp.load(loaded, storage_reader=ckptio.Reader(str(url)))
        assert_bit_exact(loaded, expected)


def test_thousands_of_small_tensors_saved_without_collectives_merge_by_columns_and_load_bit_exact(tmp_path):
    """A fragment of 3,000 keys (dcp.save without collectives, the default config) is of the shape the
    column merge takes, and the merged set loads bit-exact through dcp.load."""
    state = many_tensors()
    url = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=ckptio.Writer(url), no_dist=True, use_collectives=False)
    (fragment,) = [name for name in os.listdir(url) if name.startswith("ckptio.rank-")]
    with open(os.path.join(url, fragment), "rb") as f:
        assert json.load(f)["features"] == ["fragment"]
    loaded = zeros_like_state(state)
    dcp.load(loaded, storage_reader=ckptio.Reader(url))
    assert_bit_exact(loaded, state)


@pytest.mark.parametrize(("s3", "codec"), [("moto", "raw"), ("moto", "zstd"), ("radosgw", "raw")], indirect=["s3"])
def test_thousands_of_small_tensors_on_s3(s3, codec):
    base, options = s3
    state = many_tensors()
    url = f"{base}/many-{codec}"
    ckptio.save(state, url, config(codec), storage_options=options)
    for api in ("ckptio", "dcp"):
        loaded = zeros_like_state(state)
        load_with(api, loaded, url, options)
        assert_bit_exact(loaded, state)


def _save_many_sharded(url: str, options: dict | None, count: int) -> None:
    """Each of 2 ranks holds row shards of ``count`` DTensors (uneven rows), saved raw and zstd."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    state = {}
    for name, full in sharded_globals(count).items():
        rows = full.shape[0]
        lo = (rows + 1) // 2 * rank
        local = full[lo : lo + (rows + 1) // 2 if rank == 0 else rows].contiguous()
        state[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
    for codec in ("raw", "zstd"):
        ckptio.save(state, f"{url}/{codec}", config(codec), storage_options=options)


def sharded_globals(count: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.arange((3 + i % 4) * 8, dtype=torch.float32).reshape(-1, 8) + i for i in range(count)}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "s3"])
def test_thousands_of_sharded_tensors_resharded_onto_one_process(tmp_path, s3, where):
    """Saved on 2 ranks, loaded whole in one: each tensor's two chunks land in one destination."""
    base, options = s3 if where == "s3" else (str(tmp_path), None)
    count = 2 * IOV_MAX + 100
    spawn(2, _save_many_sharded, f"{base}/sharded", options, count)
    expected = sharded_globals(count)
    for codec, api in (("raw", "ckptio"), ("zstd", "dcp")):
        loaded = zeros_like_state(expected)
        load_with(api, loaded, f"{base}/sharded/{codec}", options)
        assert_bit_exact(loaded, expected)
    # both ranks load everything, each chunk read once and exchanged: thousands of segments per pair
    assert spawn(2, _load_many_shared, f"{base}/sharded", options, count) == [0, 0]


def _load_many_shared(url: str, options: dict | None, count: int) -> int:
    """Every tensor whole on this rank, with shared reads, raw and zstd; the count of keys that differ."""
    expected = sharded_globals(count)
    bad = 0
    for codec in ("raw", "zstd"):
        loaded = zeros_like_state(expected)
        dcp.load(loaded, storage_reader=ckptio.Reader(f"{url}/{codec}", storage_options=options, dedup_reads=True))
        bad += sum(not torch.equal(_bits(loaded[k]), _bits(expected[k])) for k in expected)
    return bad


@pytest.mark.parametrize("api", ["ckptio", "dcp"])
def test_thousands_of_safetensors_tensors_load_bit_exact(tmp_path, api, monkeypatch):
    """Whole tensors lie back to back in a safetensors file: their reads merge into requests of
    about 3x IOV_MAX pieces."""
    from safetensors.torch import save_file

    from ckptio.storage.local import LocalStore

    state = many_tensors()
    save_file(state, str(tmp_path / "model.safetensors"))
    widest = []
    read_into = LocalStore.read_into
    monkeypatch.setattr(  # observe (not replace) the requests the store is given
        LocalStore, "read_into", lambda self, rs: widest.append(max(len(r.buffers) for r in rs)) or read_into(self, rs)
    )
    loaded = zeros_like_state(state)
    if api == "ckptio":
        ckptio.load(loaded, ckptio.HFReader(tmp_path))
    else:
        dcp.load(loaded, storage_reader=ckptio.HFReader(tmp_path))
    assert_bit_exact(loaded, state)
    assert max(widest) > IOV_MAX


# --- items above 2 GiB ------------------------------------------------------------------


def big_tensor() -> torch.Tensor:
    """2 GiB + 64 KiB of fp32 whose every element differs (int32 bit patterns), cheap to make."""
    return torch.arange(BIG_ROWS * BIG_COLS, dtype=torch.int32).view(torch.float32).reshape(BIG_ROWS, BIG_COLS)


def _load_big_rows(url: str, options: dict | None = None, constant: bool = False) -> bool:
    """Load the big item as row shards on 2 ranks; each rank checks its own rows (``constant``:
    the item of ``constant_big_tensor``, else ``big_tensor``'s)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    target = distribute_tensor(torch.empty(BIG_ROWS, BIG_COLS), mesh, [Shard(0)])
    ckptio.load({"embed": target}, url, storage_options=options)
    local = target.to_local()
    if constant:
        expected = torch.full_like(local, 0.5)
        if dist.get_rank() == 1:
            expected[-1, -1] = 2.0
        return torch.equal(local, expected)
    start = 0 if dist.get_rank() == 0 else (BIG_ROWS + 1) // 2
    first = start * BIG_COLS
    expected = torch.arange(first, first + local.numel(), dtype=torch.int32).view(torch.float32)
    return torch.equal(local.reshape(-1).view(torch.int32), expected.view(torch.int32))


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_an_item_above_2_gib_whole_and_resharded(tmp_path, codec):
    url = str(tmp_path / codec)
    big = big_tensor()
    ckptio.save({"embed": big}, url, config(codec))
    out = {"embed": torch.empty_like(big)}
    dcp.load(out, storage_reader=ckptio.Reader(url))
    assert torch.equal(out["embed"].view(torch.int32), big.view(torch.int32))
    del out, big
    if codec == "raw":  # compressed row shards: the S3 test below
        assert spawn(2, _load_big_rows, url, timeout=400) == [True, True]


@pytest.mark.slow
def test_an_item_above_2_gib_saved_incrementally_loads_from_runs_past_2_gib(tmp_path):
    """Two rows of the big item changed, saved against its first save where requests cost nothing: the
    two blocks holding them written (512 KiB), the rest referenced in the base's file in runs, the last
    reaching past 2^31; the item loads exactly."""
    run = tmp_path / "run"
    big = big_tensor()
    config = ckptio.WriterConfig(
        incremental_from="previous", storage_config=ckptio.StorageConfig(read_gap_bytes=0)
    )  # 256 KiB blocks: 4 rows each
    ckptio.save({"embed": big}, str(run / "step-1"), config)
    big.view(torch.int32)[[3, BIG_ROWS // 2]] += 1  # blocks 0 and 4096 of 8193
    ckptio.save({"embed": big}, str(run / "step-2"), config)
    own = [p for p in (run / "step-2").iterdir() if p.suffix == ".ckio"]
    assert sum(p.stat().st_size for p in own) == 512 << 10
    manifest = read_manifest(open_store(str(run / "step-2")))
    ((runs),) = manifest.extents.values()
    assert [r.file.startswith("../step-1/") for r in runs] == [False, True, False, True]
    assert runs[-1].offset < 1 << 31 < runs[-1].offset + runs[-1].length == big.numel() * 4
    out = {"embed": torch.empty_like(big)}
    dcp.load(out, storage_reader=ckptio.Reader(str(run / "step-2")))
    assert torch.equal(out["embed"].view(torch.int32), big.view(torch.int32))


class _Into:
    """Stands in for torch's load planner: the one read item lands in ``target``."""

    def __init__(self, target: torch.Tensor):
        self.target = target

    def resolve_tensor(self, read_item):
        return self.target

    def commit_tensor(self, read_item, tensor):
        pass


def _load_big_rows_hf(folder: str) -> bool:
    """The big safetensors tensor as row shards on 2 ranks; each rank checks its own rows."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    target = distribute_tensor(torch.empty(BIG_ROWS, BIG_COLS), init_device_mesh("cpu", (2,)), [Shard(0)])
    dcp.load({"embed": target}, storage_reader=ckptio.HFReader(folder))
    local = target.to_local()
    first = (0 if dist.get_rank() == 0 else (BIG_ROWS + 1) // 2) * BIG_COLS
    expected = torch.arange(first, first + local.numel(), dtype=torch.int32)
    return torch.equal(local.reshape(-1).view(torch.int32), expected)


@pytest.mark.slow
def test_a_safetensors_tensor_above_2_gib_whole_by_columns_and_by_rows(tmp_path):
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from ckptio.hf.reader import read_catalog
    from ckptio.loading.box_reads import load_boxes
    from ckptio.storage import open_store

    big = big_tensor()
    save_file({"embed": big}, str(tmp_path / "model.safetensors"))
    out = {"embed": torch.empty_like(big)}
    ckptio.load(out, ckptio.HFReader(tmp_path))
    assert torch.equal(out["embed"].view(torch.int32), big.view(torch.int32))
    del out
    # the right half of every row: 32,769 runs, offsets past 2^31, read run by run into one tensor
    half = BIG_COLS // 2
    store = open_store(str(tmp_path))
    (tensor,) = read_catalog(store)
    box = ReadItem(
        LoadItemType.TENSOR, MetadataIndex("embed"), torch.Size([0, 0]), MetadataIndex("embed"),
        torch.Size([0, half]), torch.Size([BIG_ROWS, half]),
    )  # fmt: skip
    into = _Into(torch.empty(BIG_ROWS, half))
    load_boxes(store, [(box, tensor)], into, store.read_gap_bytes)
    assert torch.equal(into.target.view(torch.int32), big[:, half:].view(torch.int32))
    del big, into
    assert spawn(2, _load_big_rows_hf, str(tmp_path), timeout=400) == [True, True]


def constant_big_tensor() -> torch.Tensor:
    big = torch.full((BIG_ROWS, BIG_COLS), 0.5)
    big[-1, -1] = 2.0
    return big


@pytest.mark.slow
def test_a_compressed_item_above_2_gib_on_s3_whole_and_resharded(s3):
    """Its stored blocks are tiny, so one read merges thousands of them; its logical offsets pass
    2^31. (A raw 2 GiB object is not loaded from moto: moto copies the whole object for every ranged
    GET, which times out; real S3 serves ranges. The raw item is loaded locally above.)"""
    base, options = s3
    url = f"{base}/big-constant"
    big = constant_big_tensor()
    ckptio.save({"embed": big}, url, config("zstd"), storage_options=options)
    out = {"embed": torch.zeros_like(big)}
    ckptio.load(out, url, storage_options=options)
    assert torch.equal(out["embed"], big)
    del out, big
    assert spawn(2, _load_big_rows, url, options, True, timeout=400) == [True, True]


@pytest.mark.slow
def test_a_write_larger_than_one_system_call_moves(tmp_path):
    """The sink cuts a write into pieces a single write(2) may take."""
    store = open_store(str(tmp_path))
    size = MAX_SYSCALL_BYTES + (1 << 20)
    data = np.zeros(size, dtype=np.uint8)
    data[-1] = 7
    sink = store.open_sink("big")
    sink.write(memoryview(data))
    sink.close()
    assert os.path.getsize(tmp_path / "big") == size
    with open(tmp_path / "big", "rb") as f:
        f.seek(size - 1)
        assert f.read() == b"\x07"
