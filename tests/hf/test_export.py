"""Hugging Face safetensors export: one process and N ranks give the same files, every tensor exact."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import ckptio
from ckptio.format.columns import encode_column, encode_packed
from ckptio.tools.cli import main as cli_main
from tests.helpers import llama
from tests.helpers.documents import write_doc
from tests.helpers.harness import spawn

LIMIT = 40_000  # bytes per shard: several shards for this model


@pytest.fixture(scope="module", params=["hsdp:2x2", "dp_tp:2x2"])
def saved(request, tmp_path_factory):
    url = str(tmp_path_factory.mktemp("ckpt") / request.param.replace(":", "-"))
    full = spawn(4, llama.save, request.param, url)[0]
    return url, full


def _files(out: str) -> dict[str, bytes]:
    return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out))}


def test_export_matches_the_full_state_in_one_process_and_on_two_ranks(saved, tmp_path):
    from safetensors.torch import load_file

    url, full = saved
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    ckptio.export_safetensors(url, one, keys="model.", max_shard_size=LIMIT)
    written = spawn(2, llama.export, url, two, LIMIT)
    assert _files(one) == _files(two)  # byte-identical
    assert sorted(written[0] + written[1]) == sorted(n for n in os.listdir(one) if n.endswith(".safetensors"))
    assert written[0] and written[1]  # both ranks wrote shards

    index = json.load(open(os.path.join(one, "model.safetensors.index.json")))
    assert set(index["weight_map"]) == set(full)  # every key, prefix "model." removed
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    loaded = {}
    for shard in shards:
        tensors = load_file(os.path.join(one, shard))
        data_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert data_bytes <= LIMIT or len(tensors) == 1, (shard, data_bytes)
        assert all(index["weight_map"][k] == shard for k in tensors)
        loaded.update(tensors)
    assert set(loaded) == set(full)
    for key, value in full.items():
        assert loaded[key].dtype == torch.bfloat16 and torch.equal(loaded[key], value), key
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in full.values())


def test_the_result_loads_without_ckptio_and_names_its_source(saved, tmp_path):
    url, full = saved
    out = str(tmp_path / "out")
    assert (
        cli_main(["convert", url, out, "--format", "safetensors", "--keys", "model.", "--max-shard-size", "1MB"]) == 0
    )
    (shard,) = [n for n in os.listdir(out) if n.endswith(".safetensors")]
    script = (
        "import sys; sys.modules['ckptio'] = None\n"  # importing ckptio would fail
        "from safetensors import safe_open\n"
        f"f = safe_open({os.path.join(out, shard)!r}, 'pt')\n"
        "print(f.metadata()['written_by'], f.metadata()['source'], len(list(f.keys())))"
    )
    printed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert printed == ["ckptio", ckptio.__version__, url, str(len(full))]


def test_bad_requests_are_named(saved, tmp_path, capsys):
    url, _ = saved
    with pytest.raises(ckptio.CheckpointError, match="no tensors under the prefix 'decoder.'"):
        ckptio.export_safetensors(url, str(tmp_path / "x"), keys="decoder.")
    assert cli_main(["convert", url, str(tmp_path / "y"), "--format", "safetensors", "--max-shard-size", "lots"]) == 2
    assert "cannot read shard size 'lots'" in capsys.readouterr().err


def test_a_tensor_declared_far_beyond_its_files_is_refused_by_every_export_before_allocating(raw_checkpoint):
    """48 GiB declared in a checkpoint of a few KB: the decoder accepts the claims (they agree with
    each other), every path that allocates whole tensors checks the files first and names the file."""
    url, doc = raw_checkpoint
    numel = 12 << 30  # fp32: 48 GiB
    assert doc["keys"]["names"] == ["w", "b", "step"]
    block = 64 << 20
    blocks = math.ceil(numel * 4 / block)
    doc["tensors"]["size"] = encode_column([numel, 7])
    items = doc["items"]
    items.update(
        at=encode_column([0, numel * 4, numel * 4 + 7 * 8]), block_size=encode_column([block] + [doc["block_size"]] * 2)
    )
    doc["blocks"]["crc32c"] = encode_packed([0] * (blocks + 2), "I")
    doc["files"]["sizes"] = numel * 4 + 4096
    write_doc(url, doc)
    ckptio.Reader(url).read_metadata()  # consistent claims: they load as metadata
    with pytest.raises(ckptio.CorruptCheckpointError, match=r"data-.*\.ckio.*holds \d+ bytes, the metadata records"):
        ckptio.export_safetensors(url, os.path.join(os.path.dirname(url), "out"))
    for fmt in ("safetensors", "torch"):
        out = os.path.join(os.path.dirname(url), f"out-{fmt}" + (".pt" if fmt == "torch" else ""))
        assert cli_main(["convert", url, out, "--format", fmt]) != 0
