"""Metadata read once per load: one GET of ckptio.json (and of each safetensors header) for all the
ranks of a load, whichever API started it, and one per group when groups load apart."""

from __future__ import annotations

import pytest

from tests.helpers import hf, scenarios
from tests.helpers.harness import spawn

#: Also run against the newest torch on disk (make test-torch-newest).
pytestmark = pytest.mark.protocol


def _gets(stats, suffix: str) -> int:
    return sum(1 for r in stats.log if r.operation == "GET" and r.key.endswith(suffix))


@pytest.fixture
def saved_2x2(s3_proxy):
    proxy, base, via_proxy = s3_proxy
    url = f"{base}/ck"
    spawn(4, scenarios.save, url, (2, 2), "all_ranks", via_proxy)
    proxy.reset()
    return proxy, url, via_proxy


def test_one_read_of_the_metadata_per_load_on_four_ranks(saved_2x2):
    proxy, url, options = saved_2x2
    assert spawn(4, scenarios.load, url, (1, 4), options) == [[]] * 4  # plain dcp.load with ckptio.Reader
    assert _gets(proxy.reset(), "ckptio.json") == 1
    assert spawn(4, scenarios.load_with_ckptio, url, (2, 2), options) == [[]] * 4
    assert _gets(proxy.reset(), "ckptio.json") == 1


def test_groups_that_load_apart_read_once_each(saved_2x2):
    proxy, url, options = saved_2x2
    assert spawn(4, scenarios.load_in_pairs, url, options) == [[]] * 4
    assert _gets(proxy.reset(), "ckptio.json") == 2


def test_safetensors_headers_are_read_once_per_plain_load(s3_proxy, s3):
    proxy, base, via_proxy = s3_proxy
    weights = hf.reference_weights()
    url = f"{base}/hf"
    sizes = hf.write_reference(url, weights, shards=2, storage_options=s3[1])
    proxy.reset()
    full = spawn(4, hf.load_plain, "fsdp:4", url, via_proxy)[0]
    assert all(full[k].equal(v) for k, v in weights.items())
    stats = proxy.reset()
    assert _gets(stats, "model.safetensors.index.json") == 1
    heads = sum(1 for r in stats.log if r.operation == "HEAD" and r.key.endswith(".safetensors"))
    assert heads == len(sizes)  # one size check per file, by the rank that reads the headers


def test_a_local_disk_is_read_by_every_rank_and_remote_stores_once(tmp_path, s3):
    from ckptio.loading.reader import reads_once
    from ckptio.storage import open_store
    from ckptio.storage.local import on_network_filesystem

    assert reads_once(open_store(str(tmp_path))) is on_network_filesystem(str(tmp_path))
    assert reads_once(open_store(f"{s3[0]}/ck", s3[1]))
    url = str(tmp_path / "ck")  # and a load of four ranks from the local disk, each reading it
    spawn(4, scenarios.save, url, (2, 2), "all_ranks", None)
    assert spawn(4, scenarios.load, url, (1, 4), None) == [[]] * 4
