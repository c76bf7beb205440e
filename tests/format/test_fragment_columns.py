"""The column-by-column merge of a fragment set (``format/fragment_columns.py``) against the record merge
(``fragments.merge`` then ``versions.encode_metadata``): for any set of fragments, the same document or
the same error. Fragments are encoded by the writer's own encoder from drawn per-rank states: tensors
sharded along a dimension (empty shards included; more chunks than the tensors table takes), chunks left
to a replica's writer, plain tensors and objects several ranks hold (equal or not), per-rank objects,
items inline, raw and zstd, several block sizes, planner paths with list indices; and a rank that gives
a key another path or dtype, or stores an object where the others store a tensor."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

import ckptio
from ckptio.format.fragment_columns import columnar
from ckptio.format.fragments import Fragment, FragmentInfo, Replica, merge
from ckptio.format.names import Codec, ItemKind, data_file_name, dtype_name, fragment_name
from ckptio.format.records import Header, SavedConfig, StoredItem
from ckptio.format.versions import decode_fragment, decode_metadata, encode_metadata, merge_fragments

WHERE = "memory://run/step-1"
SAVE_ID = "0123456789abcdef"
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
BLOCK_SIZES = (64, 128, 256)


@dataclasses.dataclass
class _RankState:
    """What one rank's fragment records."""

    rank: int
    state: dict = dataclasses.field(default_factory=dict)
    paths: dict = dataclasses.field(default_factory=dict)
    items: dict = dataclasses.field(default_factory=dict)
    replicas: list = dataclasses.field(default_factory=list)
    size: int = 0  # of its data file
    inline: bool = False  # its objects kept in the document
    has_file: bool = False

    def store(self, logical: int, kind: ItemKind, dtype, shape, codec: Codec, block_size: int, seed: int):
        blocks = []
        for i, at in enumerate(range(0, logical, block_size)):
            length = min(block_size, logical - at)
            stored = length if codec is Codec.RAW else max(1, length // 2)
            blocks.append((stored, (seed * 2654435761 + i) % (1 << 32)))
        stored_bytes = sum(n for n, _ in blocks)
        name, inline = (data_file_name(SAVE_ID, self.rank), None)
        if self.inline and kind is ItemKind.BYTES:
            name, inline = "", bytes(stored_bytes)
            offset = 0
        else:
            offset, self.size, self.has_file = self.size, self.size + stored_bytes, True
        return StoredItem(name, offset, logical, kind, dtype, shape, codec, block_size, tuple(blocks), inline)


def _split(length: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk's split, an empty part at the end of the dimension (as DTensor places it)."""
    chunk = -(-length // parts)
    start = min(index * chunk, length)
    return start, min(start + chunk, length) - start


@st.composite
def fragment_sets(draw) -> tuple[int, list[_RankState]]:
    ranks = draw(st.integers(1, 5) | st.just(18))  # 18: keys of more chunks than the tensors table takes
    conflict = draw(st.sampled_from((None,) * 6 + ("path", "kind", "dtype")))  # on the last rank
    states = [_RankState(rank, inline=draw(st.booleans())) for rank in range(ranks)]
    codec = st.sampled_from((Codec.RAW, Codec.RAW, Codec.ZSTD))
    for k in range(draw(st.integers(0, 3))):  # sharded tensors
        fqn, path = f"model.layers.{k}.w", ("model", "layers", k, "w")
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))
        dtype, dim = draw(st.sampled_from(DTYPES)), draw(st.integers(0, len(shape) - 1))
        shape = shape[:dim] + (draw(st.integers(17, 40) | st.integers(0, 7)),) + shape[dim + 1 :]
        writers = draw(st.just(ranks) | st.integers(1, ranks))  # the others hold replicas, left to rank % writers
        block, item_codec = draw(st.sampled_from(BLOCK_SIZES)), draw(codec)
        for state in states:
            start, length = _split(shape[dim], writers, state.rank % writers)
            offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
            sizes = tuple(length if d == dim else n for d, n in enumerate(shape))
            if state.rank >= writers:
                state.replicas.append(Replica(fqn, offsets, state.rank % writers))
                continue
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            if conflict == "dtype" and state.rank == ranks - 1:
                dtype = DTYPES[(DTYPES.index(dtype) + 1) % len(DTYPES)]
            props = TensorProperties(dtype=dtype)
            state.state[fqn] = TensorStorageMetadata(props, torch.Size(shape), [chunk])
            state.paths[fqn] = tuple(fqn.split(".")) if conflict == "path" and state.rank == ranks - 1 else path
            logical = torch.Size(sizes).numel() * dtype.itemsize
            seed = 31 * k + sum(offsets)
            kind, name = ItemKind.TENSOR, dtype_name(dtype)
            state.items[fqn, offsets] = state.store(logical, kind, name, sizes, item_codec, block, seed)
    for k in range(draw(st.integers(0, 2))):  # plain tensors and objects several ranks hold
        tensor = draw(st.booleans())
        fqn = f"optim.state.{k}.step" if tensor else f"optim.param_groups.{k}.lr"
        holders = draw(st.lists(st.sampled_from(range(ranks)), min_size=1, unique=True))
        differs = draw(st.sets(st.sampled_from(holders), max_size=1)) if draw(st.integers(0, 2)) == 0 else set()
        logical = draw(st.integers(0, 300))
        block, item_codec = draw(st.sampled_from(BLOCK_SIZES)), draw(codec)
        for rank in sorted(holders):
            state = states[rank]
            seed = 7 + k + (rank if rank in differs else 0) * 1000
            if tensor != (conflict == "kind" and rank == ranks - 1 and len(holders) > 1):
                shape = (logical // 8,)
                whole = ChunkStorageMetadata(torch.Size((0,)), torch.Size(shape))
                state.state[fqn] = TensorStorageMetadata(
                    TensorProperties(dtype=torch.int64), torch.Size(shape), [whole]
                )
                item = state.store(shape[0] * 8, ItemKind.TENSOR, "int64", shape, item_codec, block, seed)
                state.items[fqn, (0,)] = item
            else:
                state.state[fqn] = BytesStorageMetadata()
                state.items[fqn, None] = state.store(logical, ItemKind.BYTES, None, None, item_codec, block, seed)
            state.paths[fqn] = (fqn,)
    for state in states:  # each rank's own object
        if draw(st.booleans()):
            fqn = f"dataloader.dp_rank_{state.rank}"
            state.state[fqn], state.paths[fqn] = BytesStorageMetadata(), ("dataloader", f"dp_rank_{state.rank}")
            state.items[fqn, None] = state.store(40, ItemKind.BYTES, None, None, Codec.RAW, 64, state.rank)
    return ranks, states


def _fragments(ranks: int, states: list[_RankState]) -> dict[str, bytes]:
    out = {}
    for state in states:
        files = {data_file_name(SAVE_ID, state.rank): state.size} if state.has_file else {}
        config = SavedConfig(mode="all_ranks", compression=None, max_block_size=128)
        header = Header(files, written_by="test", created_unix=1.0e9 + state.rank, save_id=SAVE_ID, config=config)
        metadata = Metadata(state_dict_metadata=state.state, planner_data=state.paths)
        info = FragmentInfo(SAVE_ID * 2, state.rank, ranks, tuple(state.replicas))
        out[fragment_name(state.rank, ranks)] = encode_metadata(metadata, state.items, header, fragment=info)
    return out


def _merged_by_records(raws: dict[str, bytes]) -> bytes:
    decoded = [
        Fragment(name, f"{WHERE}/{name}", *decode_fragment(raw, f"{WHERE}/{name}")) for name, raw in raws.items()
    ]
    return encode_metadata(*merge(decoded, WHERE))


def _outcome(merge_set, raws: dict[str, bytes]):
    try:
        return merge_set(raws)
    except ckptio.CheckpointError as error:
        return type(error), str(error)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fragment_sets())
def test_the_column_merge_writes_the_record_merges_document_or_raises_its_error(drawn):
    ranks, states = drawn
    raws = _fragments(ranks, states)
    assert all(columnar(json.loads(raw)) for raw in raws.values())
    by_columns = _outcome(lambda r: merge_fragments(r, ranks, WHERE), raws)
    assert by_columns == _outcome(_merged_by_records, raws)
    if isinstance(by_columns, bytes):
        decode_metadata(by_columns, WHERE)  # a merged set that covers every tensor decodes


def _two_ranks() -> dict[str, dict]:
    """Two ranks' fragments of a (4, 3) tensor sharded on its rows and an object each, parsed."""
    states = [_RankState(rank) for rank in range(2)]
    for state in states:
        offsets, sizes = (2 * state.rank, 0), (2, 3)
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        state.state["w"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size((4, 3)), [chunk])
        state.items["w", offsets] = state.store(24, ItemKind.TENSOR, "float32", sizes, Codec.RAW, 64, state.rank)
        state.state["o"] = BytesStorageMetadata()
        state.items["o", None] = state.store(100, ItemKind.BYTES, None, None, Codec.RAW, 64, 5)
        state.paths = {"w": ("w",), "o": ("o",)}
    return {name: json.loads(raw) for name, raw in _fragments(2, states).items()}


@pytest.mark.parametrize(
    ("table", "field", "value", "message"),
    [
        ("tensors", "file", 2, "'file' must number one of the fragment's 1 data files"),
        ("objects", "file", 2, "'file' must number one of the fragment's 1 data files"),
        ("tensors", "offsets", "BAwA=", "a chunk lies outside its tensor's shape"),  # rows 3 to 5 of 4
        ("tensors", "crc32c", "QAAAAAAABAAA=", "crc32c (one per block) holds 8-byte entries; a CRC32C has 4 bytes"),
        ("tensors", "at", "BAAAA", "at holds 3 entries of 1 bytes where 1 are expected"),
        ("objects", "inline", ["AA=="], "'inline' must hold one base64 string per inline item"),
        # rank 0's table says 0, and False == 0 in Python: a cached table must not answer for it
        ("tensors", "requires_grad", False, "requires_grad must be an integer or a packed string"),
        ("tensors", "paths", [[True]], "'paths' must hold, per key, null or a list of part counts"),
        # rank 1's copy of the object equals rank 0's and is dropped: its place is checked all the same
        ("objects", "at", 10**6, "spans bytes 1000000..1000100 of data-0123456789abcdef-r00001.ckio"),
    ],
)
def test_columns_a_fragment_cannot_join_by_are_refused_naming_the_fragment(table, field, value, message):
    """A value that would join the wrong bytes (a file number past the fragment's own files names another
    rank's file once renumbered) is refused before the fragments are joined."""
    docs = _two_ranks()
    docs[fragment_name(1, 2)][table][field] = value
    raws = {name: json.dumps(doc).encode() for name, doc in docs.items()}
    with pytest.raises(ckptio.CheckpointFormatError) as error:
        merge_fragments(raws, 2, WHERE)
    assert f"{WHERE}/{fragment_name(1, 2)}" in str(error.value) and message in str(error.value)
    with pytest.raises(ckptio.CheckpointFormatError):  # as the record merge refuses them
        _merged_by_records(raws)


_ANY_VALUE = st.one_of(
    st.integers(-3, 2**64),
    st.booleans(),
    st.none(),
    st.floats(),
    st.text(max_size=6),
    st.sampled_from(["B", "IAAAAAA==", "QAAAAAAAAAAA", {}]),
    st.lists(st.integers(-1, 9), max_size=4),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fragment_sets(), st.data())
def test_a_fragment_with_any_field_replaced_is_refused_by_name_or_merged_as_the_record_merge_merges_it(drawn, data):
    """Untrusted fragments: one field of one table (or of ``files`` or the fragment's record) replaced by
    any JSON value. The column merge raises a ``CheckpointError`` only where the record merge does too;
    a document it writes is refused when decoded (as every load decodes it) or is the record merge's."""
    ranks, states = drawn
    raws = _fragments(ranks, states)
    name = data.draw(st.sampled_from(sorted(raws)))
    doc = json.loads(raws[name])
    table = data.draw(st.sampled_from([k for k in ("tensors", "objects", "files", "fragment") if k in doc]))
    doc[table][data.draw(st.sampled_from([*sorted(doc[table]), "extra"]))] = data.draw(_ANY_VALUE)
    raws[name] = json.dumps(doc).encode()
    try:
        merged = merge_fragments(raws, ranks, WHERE)
    except ckptio.CheckpointError:
        with pytest.raises(ckptio.CheckpointError):
            _merged_by_records(raws)
        return
    try:
        decode_metadata(merged, WHERE)
    except ckptio.CheckpointFormatError:
        return
    assert merged == _merged_by_records(raws)
