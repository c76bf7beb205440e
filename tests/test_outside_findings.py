"""What suites outside this repository found (issue 34), each as its class: paths DCP's flattening
makes, values under non-string keys, the dtype conversion rule over every pair, numbers in headers
at and past int64 and the file, gc that cannot delete, unwrap of ckptio's own errors."""

from __future__ import annotations

import base64
import json
import math
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import ckptio
from ckptio.loading.conversion import is_exact, is_rounding
from ckptio.tools.cli import main as cli_main
from tests.conftest import S3_SERVERS, s3_client
from tests.harness import spawn
from tests.random_states import blank, differences, round_trip, states

#: Also run against the newest torch on disk (make test-torch-newest).
pytestmark = pytest.mark.protocol

# --- item 1: what the writer accepts, every reader accepts -------------------------------------------
T = torch.arange(6.0)
PATH_SHAPES = {
    "empty dicts before a dict in a list": {"opt": {"groups": [{}, {}, {"p": T.clone()}]}},
    "nested lists": {"a": [[T.clone(), {"x": T.clone() + 1}], [], [[{"y": T.clone() + 2}]]]},
    "empty lists and lists of lists": {"l": [[], [{}], [{"p": T.clone()}, []]], "e": []},
    "int keys (optimizer state)": {
        "opt": {
            "state": {0: {"n_iter": 7, "step": torch.tensor(3.0), "d": T.clone()}, 1: {"prev_loss": 0.25}},
            "param_groups": [{"lr": 0.1, "params": [0, 1]}],
        }
    },
    "int keys holding objects and tuples": {"s": {1: (T.clone(), 5), 2: 9, 3: [1, 2]}},
    "an int key holding a list of tensors": {"s": {0: [T.clone(), T.clone() * 2]}},
}


@pytest.mark.parametrize("name", list(PATH_SHAPES))
def test_every_path_shape_round_trips_through_ckptio_save_and_load(name, tmp_path):
    state = PATH_SHAPES[name]
    assert round_trip(state, str(tmp_path / "ckpt")) == []
    assert cli_main(["inspect", str(tmp_path / "ckpt")]) == 0
    assert cli_main(["verify", "-q", str(tmp_path / "ckpt")]) == 0


@pytest.mark.parametrize("name", list(PATH_SHAPES))
@pytest.mark.parametrize("planner", ["SafeLoadPlanner", "DefaultLoadPlanner"])
def test_plain_dcp_load_restores_every_path_shape_or_says_why(name, planner, tmp_path):
    """ckptio.SafeLoadPlanner restores each exactly; torch's DefaultLoadPlanner either does or fails
    loudly (it rebuilds lists with None for empty containers, and cannot set an object under an
    int key): it never leaves a stale value behind without a word."""
    state = PATH_SHAPES[name]
    url = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=ckptio.Writer(url), no_dist=True)
    target = blank(state)
    load_planner = ckptio.SafeLoadPlanner() if planner == "SafeLoadPlanner" else DefaultLoadPlanner()
    try:
        dcp.load(target, storage_reader=ckptio.Reader(url), planner=load_planner, no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException
        assert planner == "DefaultLoadPlanner", exc
        message = str(ckptio.unwrap(exc))
        assert "Missing key" in message or "ckptio.SafeLoadPlanner" in message, message
        return
    assert differences(state, target) == []


def test_a_save_whose_metadata_would_not_load_is_refused_before_it_commits(tmp_path, monkeypatch):
    monkeypatch.setattr(ckptio.format.records, "LIST_INDEX_LIMIT", 3)  # the decoder's bound on a list index
    url = str(tmp_path / "ckpt")
    with pytest.raises(ckptio.CheckpointError, match="would not load, so the save was not committed.*list index"):
        ckptio.save({"l": [{}, {}, {}, {}, {"p": T}]}, url)
    assert not os.path.exists(os.path.join(url, "ckptio.json"))
    ckptio.save({"l": [{}, {}, {"p": T}]}, url)  # index 2 is within the bound: saved, and it loads
    target = {"l": [{}, {}, {"p": torch.zeros(6)}]}
    ckptio.load(target, url)
    assert torch.equal(target["l"][2]["p"], T)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(state=states())
def test_random_nested_states_round_trip_in_one_process(state, tmp_path_factory):
    url = str(tmp_path_factory.mktemp("state") / "ckpt")
    assert round_trip(state, url) == []


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(state=states())
def test_random_nested_states_through_plain_dcp_load_exact_or_refused(state, tmp_path_factory):
    """Plain dcp.save/dcp.load with Writer and Reader: ckptio.SafeLoadPlanner restores every random
    state exactly; torch's DefaultLoadPlanner restores it exactly or fails loudly, never leaving a
    stale value without a word."""
    url = str(tmp_path_factory.mktemp("plain") / "ckpt")
    dcp.save(state, storage_writer=ckptio.Writer(url), no_dist=True)
    target = blank(state)
    dcp.load(target, storage_reader=ckptio.Reader(url), planner=ckptio.SafeLoadPlanner(), no_dist=True)
    assert differences(state, target) == []
    target = blank(state)
    try:
        dcp.load(target, storage_reader=ckptio.Reader(url), no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException
        message = str(ckptio.unwrap(exc))
        assert "Missing key" in message or "ckptio.SafeLoadPlanner" in message, message
        return
    assert differences(state, target) == []


@pytest.mark.parametrize("world", [2, 4])
def test_random_nested_states_round_trip_on_ranks(world, tmp_path_factory):
    """The same states through ``ckptio.save``/``load`` on 2 and 4 gloo ranks (every rank holding the
    same state: replicated objects and tensors, written once), a few examples per world size."""
    examples = iter(range(10**6))

    @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(state=states())
    def run(state):
        url = str(tmp_path_factory.mktemp(f"ranks{world}-{next(examples)}") / "ckpt")
        assert spawn(world, round_trip, state, url) == [[]] * world

    run()


# --- item 2: one dtype conversion rule, every pair --------------------------------------------------
CONVERSION_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]


def _extremes(dtype: torch.dtype) -> torch.Tensor:
    """Values at the edges of ``dtype`` (range, precision, the smallest subnormal)."""
    if dtype == torch.bool:
        return torch.tensor([False, True])
    if dtype.is_complex:
        part = _extremes(torch.float32 if dtype == torch.complex64 else torch.float64)
        return torch.complex(part, part.flip(0))
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        values = [0.0, 1.0, -1.0, info.max, -info.max, info.smallest_normal, info.smallest_normal * info.eps]
        return torch.tensor(values, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.tensor([info.min, info.max, 0, 1, -1 if info.min else 2], dtype=dtype)


def test_exact_conversions_keep_every_value_and_the_others_change_some():
    """The rule itself, checked on each type's extreme values: what it calls exact keeps every one
    (compared as Python numbers), and every other pair changes at least one (a real loss refused)."""
    for stored in CONVERSION_DTYPES:
        values = _extremes(stored)
        for wanted in CONVERSION_DTYPES:
            converted = values.to(wanted)
            kept = all(a == b for a, b in zip(values.tolist(), converted.tolist(), strict=True))
            assert kept == is_exact(stored, wanted), (stored, wanted)


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("dtypes") / "ckpt")
    state = {str(d): _extremes(d) for d in CONVERSION_DTYPES}
    ckptio.save(state, url)
    return url, state


@pytest.mark.parametrize("stored", CONVERSION_DTYPES, ids=str)
def test_every_dtype_pair_loads_exactly_rounds_on_request_or_is_refused_by_name(stored, every_dtype):
    url, state = every_dtype
    key = str(stored)
    for wanted in CONVERSION_DTYPES:
        for allow_rounding in (False, True):
            target = {key: torch.zeros(state[key].shape, dtype=wanted)}
            allowed = is_exact(stored, wanted) or (allow_rounding and is_rounding(stored, wanted))
            if allowed:
                ckptio.load(target, url, allow_rounding=allow_rounding)
                assert torch.equal(target[key], state[key].to(wanted)), (stored, wanted)
                continue
            with pytest.raises(ckptio.LossyConversionError) as info:
                ckptio.load(target, url, allow_rounding=allow_rounding)
            message = str(info.value)
            assert f"key {key!r}" in message and str(stored) in message and str(wanted) in message
            assert ("allow_rounding=True" in message) == is_rounding(stored, wanted), message
            assert torch.count_nonzero(target[key]) == 0  # nothing written


def test_the_issue_examples_are_refused_through_plain_dcp_load_too(tmp_path):
    url = str(tmp_path / "ckpt")
    saved = {
        "step": torch.tensor(1099511627781),
        "f": torch.tensor([0.5, 1.7, -2.9]),
        "u": torch.tensor([200, 255], dtype=torch.uint8),
    }
    dcp.save(saved, storage_writer=ckptio.Writer(url), no_dist=True)
    for key, dtype in (("step", torch.int32), ("f", torch.int64), ("u", torch.int8)):
        with pytest.raises(BaseException) as info:  # noqa: B017 - torch wraps it in CheckpointException
            dcp.load({key: torch.zeros(saved[key].shape, dtype=dtype)}, storage_reader=ckptio.Reader(url), no_dist=True)
        assert isinstance(ckptio.unwrap(info.value), ckptio.LossyConversionError), info.value


# --- item 3: numbers in headers bounded where they are parsed ---------------------------------------
HUGE = [2**63, 2**64, 2**63 - 1]


def _write_safetensors(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize("field", ["shape beside 0", "shape alone", "begin", "end"])
def test_safetensors_header_numbers_past_int64_or_the_file_are_refused_naming_file_and_tensor(field, value, tmp_path):
    entry: dict[str, Any] = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    if field == "shape beside 0":
        entry["shape"] = [value, 0]
        entry["data_offsets"] = [0, 0]
    elif field == "shape alone":
        entry["shape"] = [value]
    elif field == "begin":
        entry["data_offsets"] = [value, value + 8]
    else:
        entry["data_offsets"] = [0, value]
    _write_safetensors(tmp_path / "model.safetensors", {"w": entry}, bytes(8))
    with pytest.raises(ckptio.CheckpointFormatError, match=r"tensor 'w' in .*model\.safetensors"):
        ckptio.HFReader(tmp_path).prefetch_metadata()


def _v3_doc(url: str) -> dict:
    with open(os.path.join(url, "ckptio.json"), "rb") as f:
        return json.load(f)


def _write_doc(url: str, doc: dict) -> None:
    with open(os.path.join(url, "ckptio.json"), "w") as f:
        json.dump(doc, f)


@pytest.fixture
def raw_checkpoint(tmp_path):
    url = str(tmp_path / "ckpt")
    state = {"w": torch.arange(20000.0), "b": torch.arange(7), "step": 3}
    ckptio.save(state, url, ckptio.WriterConfig(inline_limit=0))
    doc = _v3_doc(url)
    assert doc["format_version"] == 3
    return url, doc


def _packed_q(values: list[int]) -> str:
    """A packed column of 8-byte entries (2^64 and more saturate at the largest one it can hold)."""
    return "Q" + base64.b64encode(b"".join(min(v, 2**64 - 1).to_bytes(8, "little") for v in values)).decode()


V3_FIELDS = {
    "chunk offset (at)": lambda doc, v: doc["keys"]["w"].__setitem__("at", v),
    "chunk offset (at, packed)": lambda doc, v: doc["keys"]["w"].__setitem__("at", _packed_q([v])),
    "tensor size": lambda doc, v: doc["keys"]["w"].__setitem__("size", [v]),
    "chunk size": lambda doc, v: doc["keys"]["w"].__setitem__("sizes", [v]),
    "chunk offsets": lambda doc, v: doc["keys"]["w"].__setitem__("offsets", [v]),
    "block size": lambda doc, v: doc["keys"]["w"].__setitem__("block_size", v),
    "object length": lambda doc, v: doc["objects"].__setitem__("length", v),
    "document block size": lambda doc, v: doc.__setitem__("block_size", v),
}
#: Past int64 only: a file size larger than the file is a claim the decoder cannot see through (it
#: reads no file); loads find the file short, and paths that allocate first check sizes (below).
V3_FIELDS_INT64_ONLY = {
    "file size": lambda doc, v: doc["files"].__setitem__("sizes", v),
    "world size": lambda doc, v: doc.__setitem__("world_size", v),
    "file rank": lambda doc, v: doc["files"].__setitem__("ranks", v),
    "mesh shape": lambda doc, v: doc.__setitem__("mesh", {"shape": [v], "dims": ["dp"]}),
    "configured block size": lambda doc, v: doc["config"].__setitem__("max_block_size", v),
}


@pytest.mark.parametrize(
    "field, value",
    [(f, v) for f in V3_FIELDS for v in [*HUGE, "past the file"]]
    + [(f, v) for f in V3_FIELDS_INT64_ONLY for v in HUGE[:2]],
)
def test_ckptio_json_numbers_past_int64_or_the_file_are_format_errors_at_decode(field, value, raw_checkpoint):
    url, doc = raw_checkpoint
    if value == "past the file":
        value = doc["files"]["sizes"] + 1
    {**V3_FIELDS, **V3_FIELDS_INT64_ONLY}[field](doc, value)
    _write_doc(url, doc)
    with pytest.raises(ckptio.CheckpointFormatError) as info:
        ckptio.Reader(url).read_metadata()
    assert "ckptio.json" in str(info.value), info.value


LEGACY_FIELDS = {
    "item offset": lambda doc, v: doc["items"][0].__setitem__("offset", v),
    "file size": lambda doc, v: doc["files"].__setitem__(next(iter(doc["files"])), v),
    "tensor size": lambda doc, v: doc["state"]["w"].__setitem__("size", [v]),
    "chunk offset": lambda doc, v: doc["state"]["w"]["chunks"][0].__setitem__("offsets", [v]),
    "logical bytes": lambda doc, v: doc["items"][0].__setitem__("logical_bytes", v),
    "list index": lambda doc, v: doc["planner_data"].__setitem__("w", ["w", v]),
}


@pytest.mark.parametrize("value", HUGE[:2])
@pytest.mark.parametrize("field", list(LEGACY_FIELDS))
def test_version_1_documents_bound_the_same_numbers(field, value, raw_checkpoint):
    """ckptio 0.1's schema (a JSON object per item), which every later ckptio still reads: the same
    bounds, through the same rule functions."""
    from ckptio.format.records import legacy_document

    url, _ = raw_checkpoint
    reader = ckptio.Reader(url)
    reader.read_metadata()
    doc = legacy_document(reader.manifest)
    assert doc["format_version"] == 1 and doc["items"][0]["fqn"] == "w"
    LEGACY_FIELDS[field](doc, value)
    _write_doc(url, doc)
    with pytest.raises(ckptio.CheckpointFormatError) as info:
        ckptio.Reader(url).read_metadata()
    assert "ckptio" in str(info.value), info.value


def test_a_tensor_declared_far_beyond_its_files_is_refused_by_every_export_before_allocating(raw_checkpoint):
    """48 GiB declared in a checkpoint of a few KB: the decoder accepts the claims (they agree with
    each other), every path that allocates whole tensors checks the files first and names the file."""
    url, doc = raw_checkpoint
    numel = 12 << 30  # fp32: 48 GiB
    record = doc["keys"]["w"]
    block = 64 << 20
    blocks = math.ceil(numel * 4 / block)
    record.update(size=[numel], sizes=[numel], at=0, block_size=block)
    record["crc32c"] = "I" + base64.b64encode(bytes(4 * blocks)).decode()
    doc["files"]["sizes"] = numel * 4 + 4096
    doc["keys"]["b"]["at"] = numel * 4
    _write_doc(url, doc)
    ckptio.Reader(url).read_metadata()  # consistent claims: they load as metadata
    with pytest.raises(ckptio.CorruptCheckpointError, match=r"data-.*\.ckio.*holds \d+ bytes, the metadata records"):
        ckptio.export_safetensors(url, os.path.join(os.path.dirname(url), "out"))
    for fmt in ("safetensors", "torch"):
        out = os.path.join(os.path.dirname(url), f"out-{fmt}" + (".pt" if fmt == "torch" else ""))
        assert cli_main(["convert", url, out, "--format", fmt]) != 0


# --- item 4: gc reports what it could not delete -----------------------------------------------------
@pytest.mark.parametrize("s3", S3_SERVERS[:1], indirect=True)
def test_gc_delete_lists_what_it_could_not_delete_and_exits_non_zero(s3_proxy, capsys):
    from tests.faultproxy import Fault

    proxy, base, options = s3_proxy
    url = f"{base}/step-5"
    ckptio.save({"w": torch.ones(10)}, url, storage_options=options)
    bucket = base.removeprefix("s3://")
    orphan = "step-5/data-00000000000000aa-r00001.ckio"
    s3_client(options).put_object(Bucket=bucket, Key=orphan, Body=b"left by a killed save")
    proxy.faults.append(Fault(lambda r: r.operation == "DELETE", 403))
    argv = ["gc", url, "--endpoint-url", options["client_kwargs"]["endpoint_url"], "--delete"]
    assert cli_main(argv) == 1
    captured = capsys.readouterr()
    assert f"could not remove s3://{bucket}/{orphan}" in captured.err and "AccessDenied" in captured.err
    assert "removed 0 of 1 file(s)" in captured.out
    keys = [o["Key"] for o in s3_client(options).list_objects_v2(Bucket=bucket)["Contents"]]
    assert orphan in keys
    proxy.faults.clear()
    assert cli_main(argv) == 0  # once the store allows it, the same command finishes the job
    keys = [o["Key"] for o in s3_client(options).list_objects_v2(Bucket=bucket)["Contents"]]
    assert orphan not in keys


# --- item 5: unwrap takes whatever a handler caught ---------------------------------------------------
def test_unwrap_returns_ckptio_errors_unchanged_and_wraps_anything_else(tmp_path):
    with pytest.raises(ckptio.CheckpointError) as info:
        ckptio.load({"w": torch.zeros(1)}, str(tmp_path / "nothing-here"))
    assert ckptio.unwrap(info.value) is info.value
    other = ValueError("boom")
    wrapped = ckptio.unwrap(other)
    assert isinstance(wrapped, ckptio.CheckpointError) and "boom" in str(wrapped) and wrapped.__cause__ is other
