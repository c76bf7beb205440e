"""GCS specifics on fake-gcs-server: what the store axis does not show."""

from __future__ import annotations

import json
import urllib.request

from ckptio.storage import RangeRequest, open_store
from tests.conftest import object_store


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
