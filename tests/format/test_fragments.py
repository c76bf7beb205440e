"""The fragments of a save without a coordinator as untrusted input (``format/fragments.py``): every
field of a fragment's own record checked, and a set that does not form one save refused by name.
Fragments are crafted from a one-process save without collectives (one fragment, its items inline)."""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest
import torch

import ckptio
from ckptio.format.names import fragment_name, parse_fragment_name
from tests.helpers.fragment_ranks import only_fragments

STATE = {"w": torch.arange(8.0), "meta": {"x": 1}}


def _saved(tmp_path) -> str:
    url = str(tmp_path / "ckpt")
    ckptio.save(STATE, url, ckptio.WriterConfig(use_collectives=False))
    only_fragments(url)  # the set as untrusted input: the loads merge it
    assert os.listdir(url) == [fragment_name(0, 1)]  # everything inline: no data file
    return url


def _doc(url: str, name: str) -> dict:
    with open(os.path.join(url, name)) as f:
        return json.load(f)


def _write(url: str, name: str, doc: dict) -> None:
    with open(os.path.join(url, name), "w") as f:
        json.dump(doc, f)


def _as_two_ranks(url: str, edit=lambda rank, doc: None) -> None:
    """The one fragment turned into a set of two (rank 1's a copy of rank 0's), each edited by ``edit``."""
    doc = _doc(url, fragment_name(0, 1))
    os.remove(os.path.join(url, fragment_name(0, 1)))
    for rank in (0, 1):
        copy = json.loads(json.dumps(doc))
        copy["fragment"].update(rank=rank, ranks=2)
        edit(rank, copy)
        _write(url, fragment_name(rank, 2), copy)


def _load_error(url: str) -> ckptio.CheckpointError:
    with pytest.raises(ckptio.CheckpointError) as info:
        ckptio.Reader(url).prefetch_metadata()
    return info.value


def test_a_one_process_save_without_collectives_is_one_fragment_and_loads(tmp_path):
    url = _saved(tmp_path)
    loaded = {"w": torch.zeros(8), "meta": {"x": 0}}
    ckptio.load(loaded, url)
    assert torch.equal(loaded["w"], STATE["w"]) and loaded["meta"] == {"x": 1}


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("save_id", "not-hex", "save_id must be 16-64 hex digits"),
        ("save_id", 7, "save_id must be 16-64 hex digits"),
        ("rank", 1, "fragment rank 1 is not below its rank count 1"),
        ("rank", -1, "the fragment's rank must be a non-negative integer"),
        ("ranks", True, "the fragment's rank count must be a non-negative integer"),
        ("replicas", [], "'replicas' must be a JSON object"),
        ("replicas", {"keys": ["w"], "offsets": [], "writers": [0]}, "replica lists differ in length"),
        ("replicas", {"keys": ["w"], "offsets": [[0]], "writers": [5]}, "names writer rank 5 of 1"),
        ("replicas", {"keys": [3], "offsets": [[0]], "writers": [0]}, "is not \\(key, \\[offsets\\], writer\\)"),
        ("replicas", {"keys": ["w"], "offsets": [[-1]], "writers": [0]}, "non-negative integer"),
    ],
)
def test_every_field_of_a_fragments_record_is_checked(tmp_path, field, value, message):
    url = _saved(tmp_path)
    doc = _doc(url, fragment_name(0, 1))
    doc["fragment"][field] = value
    _write(url, fragment_name(0, 1), doc)
    error = _load_error(url)
    assert isinstance(error, ckptio.CheckpointFormatError) and "ckptio.rank-00000-of-00001.json" in str(error)
    assert __import__("re").search(message, str(error)), error


def test_a_fragment_without_its_record_is_not_a_fragment(tmp_path):
    url = _saved(tmp_path)
    doc = _doc(url, fragment_name(0, 1))
    del doc["fragment"]
    _write(url, fragment_name(0, 1), doc)
    assert "it is not a ckptio fragment" in str(_load_error(url))


@pytest.mark.parametrize("key, offsets", [("w", [4]), ("nope", [0]), ("w", [0, 0, 0, 0, 0])])
def test_a_replica_its_writer_did_not_store_is_refused(tmp_path, key, offsets):
    url = _saved(tmp_path)
    replica = {"keys": [key], "offsets": [offsets], "writers": [0]}
    _as_two_ranks(url, lambda rank, doc: doc["fragment"]["replicas"].update(replica))
    error = _load_error(url)
    assert isinstance(error, ckptio.IncompleteCheckpointError)
    assert f"holds key {key!r} at {offsets} and left it to rank 0, whose fragment does not store it" in str(error)


def test_equal_copies_merge_and_differing_objects_are_kept_per_rank(tmp_path):
    url = _saved(tmp_path)
    _as_two_ranks(url)
    manifest = ckptio.Reader(url).prefetch_metadata()
    assert manifest.header.world_size == 2 and manifest.per_rank == {}


def _differing_inline(key: str):
    def edit(rank, doc):
        if rank == 1:  # another value of the key's one block: another checksum
            item = doc["keys"]["names"].index(key)
            crcs = bytearray(base64.b64decode(doc["blocks"]["crc32c"][1:]))
            crcs[4 * item] ^= 1
            doc["blocks"]["crc32c"] = "I" + base64.b64encode(bytes(crcs)).decode()

    return edit


def test_a_plain_tensor_two_ranks_saved_differently_is_refused(tmp_path):
    url = _saved(tmp_path)
    _as_two_ranks(url, _differing_inline("w"))
    error = _load_error(url)
    assert isinstance(error, ckptio.PerRankStateError)
    assert "different values under the plain tensor key 'w' (ranks [0]; ranks [1]" in str(error)


def test_two_fragments_naming_one_data_file_are_refused(tmp_path):
    url = str(tmp_path / "ckpt")
    ckptio.save({"w": torch.arange(70000.0)}, url, ckptio.WriterConfig(use_collectives=False))
    _as_two_ranks(only_fragments(url))
    error = _load_error(url)
    assert isinstance(error, ckptio.MixedFragmentsError) and "both name data file data-" in str(error)


def test_a_key_stored_as_a_tensor_and_as_an_object_is_refused(tmp_path):
    url = _saved(tmp_path)

    def edit(rank, doc):
        if rank == 1:  # rank 1 stores its tensor as "x" and its object as "w"
            doc["keys"]["names"] = ["x", "w"]

    _as_two_ranks(url, edit)
    error = _load_error(url)
    assert isinstance(error, ckptio.MixedFragmentsError) and "stores key 'w' as" in str(error)


def test_fragment_names_are_parsed_exactly():
    assert parse_fragment_name("ckptio.rank-00003-of-00008.json") == (3, 8)
    assert parse_fragment_name("ckptio.rank-123456-of-200000.json") == (123456, 200000)
    for name in ("ckptio.rank-8-of-8.json", "ckptio.rank-00008-of-00008.json", "ckptio.rank-00003-of-00008.json.tmp",
                 "x/ckptio.rank-00003-of-00008.json", "ckptio.rank-0003-of-00008.json", None):  # fmt: skip
        assert parse_fragment_name(name) is None, name


def test_a_fragment_keeps_one_part_of_a_tensor_as_a_boxed_key(tmp_path):
    """A fragment's key of one chunk that is part of its tensor: a 'boxed' tensor row with its item's
    box, which must hold 0 or 1, and which the merged set must cover."""
    from ckptio.format.document import decode_fragment

    url = str(tmp_path / "ckpt")
    ckptio.save(STATE, url, ckptio.WriterConfig(use_collectives=False))
    doc = _doc(only_fragments(url), fragment_name(0, 1))
    assert doc["features"] == ["fragment"] and "boxed" not in doc["tensors"]  # whole: no boxes
    doc["tensors"].update(size=16, boxed=1)
    doc["items"].update(offsets=[0], short=[8])  # the stored 8 elements: [0, 8) of 16
    manifest, _ = decode_fragment(json.dumps(doc).encode(), "fragment")
    (chunk,) = manifest.metadata.state_dict_metadata["w"].chunks
    assert list(chunk.offsets) == [0] and list(chunk.sizes) == [8]
    _write(url, fragment_name(0, 1), doc)  # the whole set: one rank, half of "w"
    with pytest.raises(ckptio.CheckpointFormatError, match="does not cover the tensor"):
        ckptio.Reader(url).prefetch_metadata()
    bad = {**doc, "tensors": {**doc["tensors"], "boxed": 2}}
    with pytest.raises(ckptio.CheckpointFormatError, match="'boxed' 0 or 1"):
        decode_fragment(json.dumps(bad).encode(), "fragment")
    unboxed = {**doc, "tensors": {**doc["tensors"], "boxed": 0}}  # its box read as the whole tensor's
    with pytest.raises(ckptio.CheckpointFormatError, match="'offsets' and 'short' must hold a column per dimension"):
        decode_fragment(json.dumps(unboxed).encode(), "fragment")


def test_a_fragment_name_claiming_billions_of_ranks_is_refused_without_counting_them(tmp_path):
    url = _saved(tmp_path)
    os.rename(os.path.join(url, fragment_name(0, 1)), os.path.join(url, fragment_name(0, 10**11)))
    error = _load_error(url)
    assert isinstance(error, ckptio.IncompleteCheckpointError)
    assert "by 100000000000 ranks committed the fragments of 1 ranks, and ranks [1, 2," in str(error)


@pytest.mark.parametrize(
    "code, message",
    [
        ("x", "each of 'paths' must be null or a list of part counts"),  # refused in the fragment
        ([True], "each of 'paths' must be null or a list of part counts"),
        ([3], "the path of key 'meta.x' does not cover the key's parts"),  # once merged
        ([-1], "the path of key 'meta.x' must be a list of part counts"),
    ],
)
def test_a_fragments_path_codes_are_refused_in_it_or_once_merged(tmp_path, code, message):
    """A fragment's path codes are checked for their type in it; the merge compares them and the merged
    document's decode decodes them, so a load and ``ckptio merge`` refuse the set, and nothing is committed."""
    from ckptio.saving.commit import commit_merged
    from ckptio.storage import open_store

    url = _saved(tmp_path)
    doc = _doc(url, fragment_name(0, 1))
    doc["keys"]["paths"] = [None, code]
    _write(url, fragment_name(0, 1), doc)
    error = _load_error(url)
    assert isinstance(error, ckptio.CheckpointFormatError) and message in str(error), error
    merged = message.startswith("the path of key")  # the merged document breaks it: not named a ckptio.json
    assert (f"{url} has no ckptio.json: that document is the merge of the fragments" in str(error)) == merged
    with pytest.raises(ckptio.CheckpointFormatError, match="paths|path of key") as refused:
        commit_merged(open_store(url))
    assert "ckptio.json" not in str(refused.value), refused.value
    assert os.listdir(url) == [fragment_name(0, 1)]


def test_fragments_giving_a_key_different_paths_are_refused(tmp_path):
    url = _saved(tmp_path)
    _as_two_ranks(url, lambda rank, doc: doc["keys"].update(paths=[None, [1, 1] if rank else [2]]))
    error = _load_error(url)
    assert isinstance(error, ckptio.MixedFragmentsError)
    assert "give key 'meta.x' different paths in the state (['meta.x'] and ['meta', 'x'])" in str(error), error


def test_fragments_repeating_one_layout_decode_each_its_own_items(tmp_path):
    """Documents that repeat a layout (the fragments of a save) are decoded together, their tensors table
    and item layout once: each still gets its own columns (boxes, files, checksums), as alone, and the
    first document that breaks a rule is named, with the error its own decode raises."""
    from ckptio.format.decode import _LAYOUTS, decode_documents, decode_tables

    url = str(tmp_path / "ckpt")
    ckptio.save(STATE, url, ckptio.WriterConfig(use_collectives=False))
    doc = _doc(only_fragments(url), fragment_name(0, 1))
    doc["tensors"].update(size=16, boxed=1)

    def half(start: int, file: int | None = None) -> dict:
        edited = json.loads(json.dumps(doc))
        edited["items"].update(offsets=[start] if start else [0], short=[8])
        if file is not None:
            edited["items"]["file"] = file
        return edited

    docs = [half(0), half(8), half(4)]
    batch = [(d, f"doc {n}", len(json.dumps(d))) for n, d in enumerate(docs)]
    together = decode_documents(batch, cover=False)
    for tables, (d, where, size), start in zip(together, batch, (0, 8, 4), strict=True):
        alone = decode_tables(d, where, size, cover=False)
        for column in ("offsets", "sizes", "length", "file", "at", "codec", "item_block_size", "starts", "ranks"):
            assert np.array_equal(getattr(tables, column), getattr(alone, column)), column
        assert tables.inline == alone.inline and tables.offsets[0, 0] == start
    shared = next(layout for _, layout in _LAYOUTS.values() if len(layout.rows) == 2)
    with pytest.raises(ValueError, match="read-only"):  # shared by the documents: no decode may change it
        shared.item_shape[0, 0] = 5

    bad = [(half(0), "good", 1000), (half(9), "outside", 1000), (half(0, file=7), "no such file", 1000)]
    with pytest.raises(ckptio.CheckpointFormatError, match="^outside: items: key 'w' has a chunk at .9. of size"):
        decode_documents(bad, cover=False)
    bad[1] = (half(0), "now good", 1000)
    with pytest.raises(
        ckptio.CheckpointFormatError, match="^no such file: items: key 'w' points at data file number 7"
    ):
        decode_documents(bad, cover=False)
    shapeless = half(0)
    shapeless["items"]["offsets"] = [[0]]  # a list where a column is
    with pytest.raises(ckptio.CheckpointFormatError, match="^shapeless: items: offsets column 0 must be an integer"):
        decode_documents([(half(0), "good", 1000), (shapeless, "shapeless", 1000)], cover=False)
