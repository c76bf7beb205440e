"""GCS specifics on fake-gcs-server: what the store axis does not show."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from ckptio.config import StorageConfig
from ckptio.format.codec import checksum
from ckptio.storage import RangeRequest, open_store
from ckptio.storage.gcs import COMPOSE_ABOVE_PARTS
from tests.conftest import object_store, store_objects

PART = 5 << 20


def test_an_object_another_tool_uploaded_as_json_is_read_as_its_bytes(request):
    base, options = object_store(request, "gcs")
    bucket = base.removeprefix("gs://")
    body = json.dumps({"weight_map": {"w": "model.safetensors"}}).encode()
    upload = urllib.request.Request(
        f"{options['endpoint_url']}/upload/storage/v1/b/{bucket}/o?uploadType=media&name=run/index.json",
        data=body,
        headers={"Content-Type": "application/json"},  # as gsutil and gcsfs label a .json file
        method="POST",
    )
    urllib.request.urlopen(upload, timeout=10).close()
    store = open_store(f"{base}/run", options)
    assert store.read("index.json") == body
    assert store.read_ranges([RangeRequest("index.json", 2, 13)]) == [body[2:13]]


@pytest.mark.slow
def test_an_object_of_more_parts_than_one_compose_takes_is_composed_in_rounds_exactly(request):
    """Above ``COMPOSE_ABOVE_PARTS`` parts an object goes up in parallel parts; above 32 (one compose
    request's limit) they are composed in rounds. Below it, one upload."""
    base, options = object_store(request, "gcs")
    store = open_store(f"{base}/run", options, StorageConfig(part_size=PART))
    data = memoryview(np.random.default_rng(0).integers(0, 256, 33 * PART + 12345, dtype=np.uint8)).cast("B")
    for name, size in [("whole.ckio", COMPOSE_ABOVE_PARTS * PART), ("rounds.ckio", len(data))]:
        sink = store.open_sink(name)
        for at in range(0, size, 1 << 20):
            block = data[at : min(at + (1 << 20), size)]
            sink.write(block, checksum(block))
        sink.close()
        assert len(sink.parts) == (0 if name == "whole.ckio" else 33)  # the tail joins the last part
        assert store.read(name) == data[:size]
    assert sorted(store_objects(f"{base}/run", options)) == ["rounds.ckio", "whole.ckio"]  # no parts left
