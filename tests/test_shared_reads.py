"""Reader(dedup_reads=...): stored bytes that several ranks need are read once and shared over the
process group; bit-exact on every layout, and a failure on one rank is the same error on all."""

from __future__ import annotations

import os
from functools import partial

import pytest

from . import models, scenarios
from .harness import spawn

LOADS = [(4, (2, 2)), (4, (4, 1)), (2, (1, 2))]


def _stored_data_bytes(moto_server: str, url: str) -> int:
    from .test_s3 import _objects

    return sum(size for key, size in _objects(moto_server, url).items() if key.endswith(".ckio"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,compression,dedup", [("replica_group", None, True), ("all_ranks", "zstd", "auto")], ids=["raw", "zstd"]
)
def test_s3_serves_each_stored_byte_once(s3_proxy, moto_server, mode, compression, dedup):
    proxy, base, options = s3_proxy
    url = f"{base}/{mode}"
    spawn(4, partial(scenarios.save, compression=compression), url, (2, 2), mode, options)
    stored = _stored_data_bytes(moto_server, url)
    proxy.reset()
    for procs, mesh in LOADS:
        assert spawn(procs, scenarios.load_shared, url, mesh, options, dedup) == [[]] * procs
        served = sum(v for key, v in proxy.reset().get_bytes.items() if key.endswith(".ckio"))
        assert served <= 1.05 * stored, (mesh, dedup, served / stored)
    assert spawn(4, scenarios.load_shared, url, (4, 1), options, False) == [[]] * 4
    served = sum(v for key, v in proxy.reset().get_bytes.items() if key.endswith(".ckio"))
    assert served >= 3.9 * stored  # without sharing, each of the 4 replicas reads everything


def test_local_layouts_and_one_process(tmp_path):
    url = str(tmp_path / "ckpt")
    spawn(4, partial(scenarios.save, compression="zstd"), url, (2, 2), "all_ranks")
    for procs, mesh in LOADS:
        assert spawn(procs, scenarios.load_shared, url, mesh, None, True) == [[]] * procs, mesh
    assert spawn(0, scenarios.load_shared, url, None, None, True) == [[]]


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
