"""The 1.0 document's own rules, table by table (``format/decode.py``): each breach of a saved document
is a named ``CheckpointFormatError``; the untouched document decodes to what was saved. The rules every
format shares are crafted from records in ``test_rules.py``; hostile values anywhere in ``test_v3.py``."""

from __future__ import annotations

import json

import pytest
import torch

import ckptio
from ckptio.errors import CheckpointFormatError
from ckptio.format.columns import encode_column
from ckptio.format.document import decode_fragment, decode_metadata, merge_fragments
from ckptio.format.names import fragment_name
from tests.helpers.fragment_ranks import only_fragments

STATE = {"w": torch.arange(64.0).reshape(8, 8), "b": torch.ones(3, dtype=torch.bfloat16), "lr": 0.5, "n": 3}


@pytest.fixture(scope="module")
def doc(tmp_path_factory) -> dict:
    url = str(tmp_path_factory.mktemp("doc") / "ckpt")
    ckptio.save(STATE, url, ckptio.WriterConfig(tuning=ckptio.Tuning(inline_limit=0)))
    with open(f"{url}/ckptio.json") as f:
        return json.load(f)


def _decode(doc: dict):
    return decode_metadata(json.dumps(doc).encode(), "crafted")


def test_the_saved_document_is_version_8_with_its_tables_and_decodes(doc):
    assert doc["format_version"] == 8 and "features" not in doc
    assert doc["keys"]["names"] == ["w", "b", "lr", "n"] and doc["keys"]["kind"] == encode_column([0, 0, 1, 1])
    assert set(doc) >= {"keys", "tensors", "items", "blocks", "files"} and "mesh" not in doc  # null: not written
    manifest = _decode(doc)
    assert manifest.metadata.state_dict_metadata["b"].properties.dtype == torch.bfloat16
    assert sorted(manifest.metadata.planner_data) == ["b", "lr", "n", "w"]


BREACHES = [
    (lambda d: d.update(features=["hyperspace"]), "feature 'hyperspace', which this ckptio does not know"),
    (lambda d: d.update(features="key_prefix"), "list of distinct feature names"),
    (lambda d: d.update(features=["fragment", "fragment"]), "list of distinct feature names"),
    (lambda d: d.update(fragment={"save_id": "ab" * 8}), "'fragment' belongs to feature 'fragment'"),
    (lambda d: d.update(chain={"base": "x", "depth": 1}), "'chain' belongs to feature 'incremental'"),
    (lambda d: d.update(extents={"items": 1}), "'extents' belongs to feature 'incremental'"),
    (lambda d: d["files"].update(key_prefix="sha256-2"), "only feature 'key_prefix'"),
    (lambda d: d.pop("keys"), "required table 'keys'"),
    (lambda d: d.pop("items"), "required table 'items'"),
    (lambda d: d.pop("blocks"), "required table 'blocks'"),
    (lambda d: d["keys"].update(names=["w", "w", "lr", "n"]), "distinct key names"),
    (lambda d: d["keys"].update(names=["w", "b", "lr"]), "entries"),
    (lambda d: d["keys"].update(paths=[None]), "one entry per key"),
    (lambda d: d["keys"].update(kind=encode_column([0, 0, 1, 3])), "key 'n' has unknown kind"),
    (lambda d: d["keys"].update(count=encode_column([1, 1, 2, 1])), "key 'lr' has 2 items: an object has one"),
    (lambda d: d["keys"].update(count=10**12), "more than its metadata could describe"),
    (lambda d: d["tensors"].update(dtypes=["float32", "nonsense"]), "unknown dtype 'nonsense'"),
    (lambda d: d["tensors"].update(dtype=7), "'dtype' must index 'dtypes'"),
    (lambda d: d["tensors"].update(ndim=65, size=0), "'ndim' be at most 64"),
    (lambda d: d["tensors"].update(requires_grad=2), "'requires_grad' and 'boxed' 0 or 1"),
    (lambda d: d["tensors"].update(boxed=encode_column([1, 0])), "a column per dimension"),
    (lambda d: d["tensors"].update(size=encode_column([2**62, 2**62, 3])), "more elements than a tensor can hold"),
    (lambda d: d["items"].update(offsets=[0], short=[1]), r"a column per dimension \(0\)"),
    (lambda d: d["items"].update(length=encode_column([1, 2, 3])), "holds 3 entries of 1 bytes where 2 are expected"),
    (lambda d: d["items"].update(file=9), "points at data file number 9"),
    (lambda d: d["items"].update(at=2**62), "spans bytes"),
    (lambda d: d["items"].update(codec=encode_column([2, 0, 0, 0])), "byte planes"),  # 4-byte fp32: fine
    (lambda d: d["items"].update(codec=encode_column([0, 0, 2, 0])), "key 'lr' uses byte planes but is not a tensor"),
    (lambda d: d["items"].update(codec=9), "unknown codec number 9"),
    (lambda d: d["items"].update(block_size=100), "invalid block_size 100"),
    (lambda d: d["items"].update(inline=["AAAA"]), "one base64 string per inline item"),
    (lambda d: d["blocks"].update(crc32c=d["blocks"]["crc32c"][:-4]), "crc32c"),
    (lambda d: d["blocks"].update(crc32c=7), "must be a packed string"),
    (lambda d: d["blocks"].update(stored_lengths="B" + "A" * 8), "'stored_lengths' must be present exactly when"),
    (lambda d: d["blocks"].update(digests="I"), "'digests' belongs to feature 'incremental'"),
    (
        lambda d: d.update(planner_data={"w": ["w"]}, keys={**d["keys"], "paths": [None] * 4}),
        "'paths' is only for 'planner_data': 'paths'",
    ),
    (lambda d: d["keys"].update(paths=[[9], None, None, None]), "path of key 'w' does not cover"),
]


@pytest.mark.parametrize(("breach", "match"), BREACHES, ids=[m[:40] for _, m in BREACHES])
def test_every_table_rule_has_a_named_error(doc, breach, match):
    crafted = json.loads(json.dumps(doc))
    breach(crafted)
    if match == "byte planes":  # fp32 in byte planes is valid: a raw item then mislabeled fails its length check
        crafted["items"]["codec"] = encode_column([2, 0, 0, 0])
        with pytest.raises(CheckpointFormatError, match="stored_lengths"):
            _decode(crafted)
        return
    with pytest.raises(CheckpointFormatError, match=match) as info:
        _decode(crafted)
    assert "crafted" in str(info.value)


def test_a_fragment_is_not_a_checkpoint_and_a_checkpoint_is_not_a_fragment(doc, tmp_path):
    with pytest.raises(CheckpointFormatError, match="not a ckptio 1.0 fragment"):
        decode_fragment(json.dumps(doc).encode(), "ckptio.json")
    url = str(tmp_path / "frag")
    ckptio.save(STATE, url, ckptio.WriterConfig(use_collectives=False, tuning=ckptio.Tuning(inline_limit=0)))
    with open(f"{only_fragments(url)}/{fragment_name(0, 1)}") as f:
        fragment = json.load(f)
    with pytest.raises(CheckpointFormatError, match="fragment of a save without a coordinator, not"):
        _decode(fragment)
    legacy = {**fragment, "format_version": 6}  # ckptio 0.2's
    with pytest.raises(CheckpointFormatError, match="format version 6.*load it with the ckptio that wrote it"):
        merge_fragments({fragment_name(0, 1): json.dumps(legacy).encode()}, 1, url)


def test_a_fragment_keeping_objects_per_rank_is_refused_by_the_merge(tmp_path):
    url = str(tmp_path / "frag")
    ckptio.save(STATE, url, ckptio.WriterConfig(use_collectives=False, tuning=ckptio.Tuning(inline_limit=0)))
    with open(f"{only_fragments(url)}/{fragment_name(0, 1)}") as f:
        fragment = json.load(f)
    fragment["keys"]["kind"] = encode_column([0, 0, 2, 1])
    fragment["items"]["ranks"] = 0
    decode_fragment(json.dumps(fragment).encode(), "one")  # a valid document on its own
    with pytest.raises(CheckpointFormatError, match="keeps objects per rank, which only a merge does"):
        merge_fragments({fragment_name(0, 1): json.dumps(fragment).encode()}, 1, url)
