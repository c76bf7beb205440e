"""ckptio.HFReader: Hugging Face safetensors weights (reference writer and ckptio's exporter), local
and on S3, into one process, FSDP2(4), TP(4), HSDP 2x2 and FSDP2+TP; hostile headers refused."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import ckptio
from ckptio.errors import CheckpointFormatError, CheckpointNotFoundError, CorruptCheckpointError
from ckptio.hf.format import HEADER_PROBE_BYTES, parse_header, parse_index
from tests.conftest import STORES_SLOW_BEYOND_MOTO
from tests.helpers import hf
from tests.helpers.harness import spawn


@pytest.fixture(scope="module")
def weights():
    return hf.reference_weights()


@pytest.fixture(scope="module")
def files(weights, tmp_path_factory):
    url = str(tmp_path_factory.mktemp("hf") / "Llama-tiny")
    hf.write_reference(url, weights, shards=2)
    return url


def assert_loaded(full: dict, weights: dict, dtype=torch.bfloat16) -> None:
    assert set(full) == set(weights)
    for key, value in weights.items():
        assert full[key].dtype == dtype, key
        assert torch.equal(full[key], value.to(dtype)), key


# --- one process ---------------------------------------------------------------------------------
def test_one_process_loads_every_tensor_beside_state_the_files_lack(files, weights):
    full, needed = hf.load_layout("single", files)
    assert_loaded(full, weights)
    assert needed == sum(v.numel() * 2 for v in weights.values())


def test_a_single_file_a_named_file_and_a_named_index_load(weights, tmp_path):
    from safetensors.torch import save_file

    save_file(weights, str(tmp_path / "model.safetensors"))
    for url in (tmp_path, tmp_path / "model.safetensors"):
        state = {k: torch.zeros_like(v) for k, v in weights.items()}
        dcp.load(state, storage_reader=ckptio.HFReader(url))
        assert all(torch.equal(state[k], v) for k, v in weights.items())
    sharded = tmp_path / "sharded"
    hf.write_reference(str(sharded), weights, shards=3)
    os.rename(sharded / "model.safetensors.index.json", sharded / "weights.safetensors.index.json")
    for url in (sharded, sharded / "weights.safetensors.index.json"):  # the folder's only index, or named
        state = {k: torch.zeros_like(v) for k, v in weights.items()}
        ckptio.load(state, ckptio.HFReader(url))
        assert all(torch.equal(state[k], v) for k, v in weights.items())


def test_bf16_files_load_into_fp32_exactly_and_fp32_files_round_into_bf16(files, weights, tmp_path):
    full, _ = hf.load_layout("single", files, dtype=torch.float32)
    assert_loaded(full, weights, torch.float32)
    wide = {k: v.float() + 1e-3 for k, v in weights.items()}  # values bf16 cannot hold
    hf.write_reference(str(tmp_path), wide, shards=1)
    full, _ = hf.load_layout("single", str(tmp_path), dtype=torch.bfloat16)
    for key, value in wide.items():
        assert torch.equal(full[key], value.to(torch.bfloat16)), key  # round to nearest even, as torch casts


def test_an_integer_file_does_not_load_into_a_float_state_nor_narrow(tmp_path):
    from safetensors.torch import save_file

    save_file({"ids": torch.arange(10, dtype=torch.int64)}, str(tmp_path / "model.safetensors"))
    for wanted in (torch.zeros(10), torch.zeros(10, dtype=torch.int32)):
        with pytest.raises(CheckpointFormatError, match=r"key 'ids' .* holds torch.int64.*can change values"):
            ckptio.load({"ids": wanted}, ckptio.HFReader(tmp_path))
    widened = {"ids": torch.zeros(10, dtype=torch.int64)}
    ckptio.load(widened, ckptio.HFReader(tmp_path))
    assert torch.equal(widened["ids"], torch.arange(10))


def test_key_maps_prefix_function_collisions_and_no_match(files, weights):
    state = {"net": {k.replace("model.", "", 1): torch.zeros_like(v) for k, v in weights.items()}}
    ckptio.load(state, ckptio.HFReader(files, key_map=lambda name: "net." + name.replace("model.", "", 1)))
    assert all(torch.equal(state["net"][k.replace("model.", "", 1)], v) for k, v in weights.items())

    only_layer_0 = {k: torch.zeros_like(v) for k, v in weights.items() if ".layers.0." in k}
    ckptio.load(only_layer_0, ckptio.HFReader(files, key_map=lambda n: n if ".layers.0." in n else None))
    assert all(torch.equal(v, weights[k]) for k, v in only_layer_0.items())

    compiled = {"_orig_mod.model.norm.weight": torch.zeros(64, dtype=torch.bfloat16)}  # torch.compile's names
    dcp.load(compiled, storage_reader=ckptio.HFReader(), checkpoint_id=files)  # the location given to dcp.load
    assert torch.equal(compiled["_orig_mod.model.norm.weight"], weights["model.norm.weight"])

    with pytest.raises(CheckpointFormatError, match="both map to the state key 'x'"):
        ckptio.load({"x": torch.zeros(1)}, ckptio.HFReader(files, key_map=lambda name: "x"))
    with pytest.raises(ckptio.CheckpointError, match=r"none of the 1 keys of the state .* Pass key_map="):
        ckptio.load({"net": {"embed_tokens.weight": torch.zeros(1)}}, ckptio.HFReader(files))


def test_plain_dcp_load_needs_every_state_key_unless_partial_loads_are_allowed(files, weights):
    state = {k: torch.zeros_like(v) for k, v in weights.items()}
    dcp.load(state, storage_reader=ckptio.HFReader(files))
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    extra = {"model.embed_tokens.weight": torch.zeros_like(weights["model.embed_tokens.weight"]), "step": 3}
    with pytest.raises(BaseException, match="Missing key in checkpoint state_dict: step"):
        dcp.load(extra, storage_reader=ckptio.HFReader(files))
    dcp.load(extra, storage_reader=ckptio.HFReader(files), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert extra["step"] == 3 and torch.equal(extra["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])


def test_a_ckptio_checkpoint_folder_says_which_reader_to_use(tmp_path):
    ckptio.save({"w": torch.ones(2)}, str(tmp_path / "ck"))
    with pytest.raises(CheckpointNotFoundError, match="holds a ckptio checkpoint: load it with ckptio.Reader"):
        ckptio.load({"w": torch.zeros(2)}, ckptio.HFReader(tmp_path / "ck"))
    with pytest.raises(ckptio.CheckpointError, match=r"holds safetensors files .*load them with ckptio.HFReader"):
        hf.write_reference(str(tmp_path / "hf"), {"w": torch.ones(2)}, shards=1)
        ckptio.load({"w": torch.zeros(2)}, str(tmp_path / "hf"))


# --- untrusted headers and indexes -----------------------------------------------------------------
def _file(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


GOOD = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
CRAFTED = [
    ({"a": {**GOOD, "dtype": "F4"}}, "dtype 'F4' is not one ckptio can load"),
    ({"a": {**GOOD, "dtype": 7}}, "dtype 7 is not one"),
    ({"a": {**GOOD, "shape": [2, -2]}}, r"shape \[2, -2\] is not a list of non-negative integers"),
    ({"a": {**GOOD, "shape": [2, 2.0]}}, "is not a list of non-negative integers"),
    ({"a": {**GOOD, "shape": [True, 2]}}, "is not a list of non-negative integers"),
    ({"a": {**GOOD, "shape": [1] * 65}}, "is not a list of non-negative integers"),
    ({"a": {**GOOD, "data_offsets": [0, 12]}}, r"hold 12 bytes, but F32 \[2, 2\] needs 16"),
    ({"a": {**GOOD, "data_offsets": [16, 0]}}, "hold -16 bytes"),
    ({"a": {**GOOD, "data_offsets": [0]}}, "is not \\[begin, end\\]"),
    ({"a": {**GOOD, "data_offsets": [16, 32]}}, "lie past the end of the file, which holds 16 bytes"),
    ({"a": {**GOOD, "shape": [2**40, 2**40], "data_offsets": [0, 2**82]}}, "more elements than a tensor can hold"),
    ({"a": GOOD, "b": {**GOOD, "shape": [2], "data_offsets": [8, 16]}}, "tensors 'a' and 'b' overlap"),
    ({"a": {**GOOD, "extra": 1}}, "expected exactly 'dtype', 'shape' and 'data_offsets'"),
    ({"a": [1, 2]}, "expected exactly"),
    ({"__metadata__": {"format": 1}, "a": GOOD}, "'__metadata__' must map strings to strings"),
    (b'{"a": 1, "a": 2}', "the key 'a' appears twice"),
    (b"[1, 2]", "expected a JSON object"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
]


@pytest.mark.parametrize("header, message", CRAFTED, ids=range(len(CRAFTED)))
def test_crafted_headers_get_a_named_error(header, message):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with pytest.raises(CheckpointFormatError, match=message):
        parse_header(raw, "x.safetensors", 8 + len(raw) + 16)


@pytest.mark.parametrize(
    "index, message",
    [
        ({"weight_map": {"a": "../secret.safetensors"}}, "not a file name in this folder"),
        ({"weight_map": {"a": "/etc/passwd"}}, "not a file name in this folder"),
        ({"weight_map": {"a": 3}}, "not a file name in this folder"),
        ({"weight_map": {}}, "must be a non-empty object"),
        ({"metadata": {}}, "must be a non-empty object"),
    ],
)
def test_crafted_indexes_get_a_named_error(index, message):
    with pytest.raises(CheckpointFormatError, match=message):
        parse_index(json.dumps(index).encode(), "model.safetensors.index.json")


def test_hostile_files_are_refused_before_allocation_naming_the_file(tmp_path, weights):
    def load(folder):
        state = {"a": torch.zeros(2, 2)}
        ckptio.load(state, ckptio.HFReader(folder))
        return state

    cases = {
        "huge-length": (_file(b"{}", length=2**63), "more than safetensors' limit"),
        "length-past-end": (_file(b"{}", length=1000), "the file holds only 2 after the length"),
        "too-short": (b"\x01\x02", "too short for a safetensors file"),
        "truncated-data": (_file({"a": GOOD}, b"\x00" * 8), "lie past the end of the file"),
    }
    for name, (data, message) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(data)
        with pytest.raises(CheckpointFormatError, match=message) as info:
            load(folder)
        assert "model.safetensors" in str(info.value)
    big_header = {"__metadata__": {"pad": "x" * (2 * HEADER_PROBE_BYTES)}, "a": GOOD}  # read in two requests
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "model.safetensors").write_bytes(_file(big_header, torch.ones(2, 2).numpy().tobytes()))
    assert torch.equal(load(tmp_path / "big")["a"], torch.ones(2, 2))

    folder = tmp_path / "index"
    hf.write_reference(str(folder), weights, shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    holder = index["weight_map"]["lm_head.weight"]
    index["weight_map"]["lm_head.weight"] = "model-00009-of-00009.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointNotFoundError, match="model-00009-of-00009.safetensors does not exist"):
        ckptio.load({"lm_head.weight": torch.zeros(100, 64)}, ckptio.HFReader(folder))
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    index["weight_map"]["lm_head.weight"] = second if holder == first else first
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError, match="'lm_head.weight' to .* whose header does not list it"):
        ckptio.load({"lm_head.weight": torch.zeros(100, 64)}, ckptio.HFReader(folder))


def test_a_file_cut_short_after_its_header_was_read_is_a_named_error(files, weights, tmp_path):
    reader = ckptio.HFReader(files)
    catalog = reader.prefetch_metadata()  # headers read while the files were whole
    victim = max(catalog, key=lambda t: t.start + t.nbytes)
    path = os.path.join(files, victim.file)
    data = open(path, "rb").read()
    copy = tmp_path / "cut"
    copy.mkdir()
    for name in os.listdir(files):
        (copy / name).write_bytes(open(os.path.join(files, name), "rb").read())
    reader = ckptio.HFReader(copy)
    reader.prefetch_metadata()
    (copy / victim.file).write_bytes(data[: victim.start + 1])
    with pytest.raises(CheckpointException) as info:  # dcp.load with the headers read before the cut
        dcp.load({victim.name: torch.zeros(victim.shape, dtype=victim.dtype)}, storage_reader=reader)
    error = ckptio.unwrap(info.value)
    assert isinstance(error, CorruptCheckpointError) and f"{victim.file} is shorter than its header says" in str(error)


class _Boxes:
    """Stands in for torch's load planner: each read item's box lands in its own tensor."""

    def __init__(self, dtype):
        self.dtype, self.out = dtype, {}

    def resolve_tensor(self, read_item):
        return self.out.setdefault(read_item.dest_index, torch.empty(tuple(read_item.lengths), dtype=self.dtype))

    def commit_tensor(self, read_item, tensor):
        pass


@pytest.mark.parametrize("gap", [0, 1 << 20], ids=["run-by-run", "one-span"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["direct", "converted"])
def test_column_and_block_boxes_read_exactly_from_local_files(tmp_path, gap, dtype):
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from ckptio.hf.reader import read_catalog
    from ckptio.loading.box_reads import load_boxes
    from ckptio.storage import open_store

    full = torch.randn(37, 3, 50).to(torch.bfloat16)
    save_file({"pad": torch.ones(7, dtype=torch.bfloat16), "w": full}, str(tmp_path / "model.safetensors"))
    store = open_store(str(tmp_path))
    (tensor,) = [t for t in read_catalog(store) if t.name == "w"]
    boxes = [((0, 0, 10), (37, 3, 20)), ((5, 1, 0), (30, 2, 50)), ((36, 2, 49), (1, 1, 1)), ((0, 0, 0), (0, 3, 50))]
    items = [
        ReadItem(
            LoadItemType.TENSOR,
            MetadataIndex("w", torch.Size(o)),
            torch.Size([0, 0, 0]),
            MetadataIndex("w"),
            torch.Size(o),
            torch.Size(n),
        )
        for o, n in boxes
    ]
    planner = _Boxes(dtype)
    load_boxes(store, [(item, tensor) for item in items], planner, gap)
    for (o, n), item in zip(boxes, items, strict=True):
        expected = full[o[0] : o[0] + n[0], o[1] : o[1] + n[1], o[2] : o[2] + n[2]]
        assert torch.equal(planner.out[item.dest_index], expected.to(dtype)), (o, n)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: tensor.start + 1000])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors is shorter than its header says"):
        load_boxes(store, [(items[0], tensor)], _Boxes(dtype), gap)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ckptio.StorageError, match="disappeared while it was read"):
        load_boxes(store, [(items[0], tensor)], _Boxes(dtype), gap)


# --- ranks: FSDP2(4), TP(4), HSDP 2x2, FSDP2+TP --------------------------------------------------
@pytest.mark.parametrize("layout", ["fsdp:4", "tp:4", "hsdp:2x2", "dp_tp:2x2"])
def test_reference_files_load_into_each_layout_bit_exact(files, weights, layout):
    results = spawn(4, hf.load_layout, layout, files)
    assert_loaded(results[0][0], weights)


def test_a_rank_whose_state_matches_nothing_fails_every_rank(files):
    outcomes = spawn(2, hf.load_where_rank_1_matches_nothing, files, env={"CKPTIO_TEST_PG_TIMEOUT": "60"})
    assert all(o.startswith("CheckpointError") and "none of the 1 keys" in o for o in outcomes), outcomes
    assert outcomes[0].startswith("CheckpointError: rank 1: ")


def test_plain_dcp_load_on_ranks_and_the_exporters_files_into_another_mesh(weights, tmp_path):
    out = str(tmp_path / "exported")
    full = spawn(4, hf.exported_from, "dp_tp:2x2", str(tmp_path / "ck"), out)[0]
    assert {n for n in os.listdir(out)} >= {"model.safetensors.index.json"}
    loaded = spawn(4, hf.load_plain, "hsdp:2x2", out)[0]
    assert_loaded(loaded, full)


# --- S3 -----------------------------------------------------------------------------------------
def _served(stats, sizes) -> int:
    return sum(n for key, n in stats.get_bytes.items() if key.rsplit("/", 1)[-1] in sizes)


def _probes(sizes) -> int:
    return sum(min(size, HEADER_PROBE_BYTES) for size in sizes.values())  # one header read per file (rank 0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, reader", [("hsdp:2x2", {"dedup_reads": True}), ("tp:4", {"storage_config": {"read_gap_bytes": 0}})]
)
def test_s3_loads_read_each_needed_byte_once(s3_proxy, s3, weights, layout, reader):
    proxy, base, via_proxy = s3_proxy
    url = f"{base}/Llama-tiny"
    sizes = hf.write_reference(url, weights, shards=2, storage_options=s3[1])
    proxy.reset()
    results = spawn(4, hf.load_layout, layout, url, via_proxy, torch.bfloat16, reader)
    assert_loaded(results[0][0], weights)
    served = _served(proxy.reset(), sizes)
    data = sum(v.numel() * 2 for v in weights.values())
    if layout == "hsdp:2x2":  # shared reads: the replicas' identical slices come from storage once
        assert served <= 1.05 * data + _probes(sizes), (served, data)
    else:  # each rank reads its column shards row by row, and the replicated norms/embeddings whole
        needed = sum(n for _, n in results)
        assert needed > data and served <= 1.05 * needed + _probes(sizes), (served, needed)


@pytest.mark.parametrize("store", STORES_SLOW_BEYOND_MOTO, indirect=True)
def test_the_exporters_files_on_an_object_store_load_into_fsdp(store, tmp_path):
    base, options = store
    out = f"{base}/exported"
    full = spawn(4, hf.exported_from, "dp_tp:2x2", str(tmp_path / "ck"), out, options)[0]
    assert "model.safetensors.index.json" in hf.file_names(out, options)
    assert_loaded(spawn(4, hf.load_layout, "fsdp:4", out, options)[0][0], full)
