from __future__ import annotations

import hashlib
import json
import os
import re
import threading

import pytest


@pytest.fixture(scope="session")
def moto_server():
    """A moto S3 server on 127.0.0.1 (real HTTP), shared by the session; yields its endpoint URL."""
    from ckptio.bench.s3server import local_s3_server

    with local_s3_server() as endpoint:
        yield endpoint


#: The S3 servers a test can ask the ``s3`` fixture for: ``@pytest.mark.parametrize("s3", S3_SERVERS,
#: indirect=True)`` runs it on each (moto alone otherwise).
S3_SERVERS = ["moto", "radosgw"]


#: Every object store a test can ask the ``store`` fixture for: ``@pytest.mark.parametrize("store", STORES,
#: indirect=True)`` runs it on S3 (moto and radosgw), GCS (fake-gcs-server) and Azure Blob (Azurite).
STORES = ["moto", "radosgw", "gcs", "azure"]
#: ``STORES`` for a heavy scenario: moto in the main run, the other stores in the slow one (CI runs both).
STORES_SLOW_BEYOND_MOTO = ["moto"] + [pytest.param(kind, marks=pytest.mark.slow) for kind in STORES[1:]]


def _bucket_name(request) -> str:
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:10]
    stem = request.node.originalname.lower().replace("_", "-")[:40].strip("-")
    return f"ckptio-{re.sub('-+', '-', stem)}-{digest}"  # Azure refuses '--' in a container's name


@pytest.fixture(scope="session")
def gcs_server():
    """fake-gcs-server on 127.0.0.1 for the session (``ckptio.bench.emulators``); yields its endpoint, or
    skips saying why it cannot run."""
    from ckptio.bench import emulators

    try:
        with emulators.local_gcs_server() as endpoint:
            yield endpoint
    except emulators.Unavailable as exc:
        pytest.skip(f"fake-gcs-server unavailable: {exc}")


@pytest.fixture(scope="session")
def azure_server():
    """Azurite's blob service on 127.0.0.1 for the session; yields its connection string, or skips saying
    why it cannot run (``make azurite`` installs it)."""
    from ckptio.bench import emulators

    try:
        with emulators.local_azure_server() as connection_string:
            yield connection_string
    except emulators.Unavailable as exc:
        pytest.skip(f"Azurite unavailable: {exc}")


@pytest.fixture
def store(request):
    """A fresh bucket or container on the object store the test is parametrized with (moto unless
    parametrized; ``STORES``); yields (base URL, storage_options)."""
    return object_store(request, getattr(request, "param", "moto"))


def object_store(request, kind: str) -> tuple[str, dict]:
    """What the ``store`` fixture yields, for a test whose own parameter names the store (``kind``: one of
    ``STORES``, or ``s3`` for moto)."""
    from ckptio.bench import emulators

    name = _bucket_name(request)
    if kind == "gcs":
        endpoint = request.getfixturevalue("gcs_server")
        emulators.create_gcs_bucket(endpoint, name)
        return f"gs://{name}", emulators.gcs_options(endpoint)
    if kind == "azure":
        connection_string = request.getfixturevalue("azure_server")
        emulators.create_azure_container(connection_string, name)
        return f"az://{name}", emulators.azure_options(connection_string)
    return _s3_bucket(request, "moto" if kind == "s3" else kind)


def cli_storage_options(options: dict | None) -> list[str]:
    """The CLI arguments that hand ``options`` to a command."""
    return ["--storage-options", json.dumps(options)] if options else []


def store_objects(url: str, options: dict) -> dict[str, int]:
    """Every object below ``url`` on any store: name relative to ``url`` -> size."""
    from ckptio.storage import open_store

    return open_store(url, options).list_sizes() or {}


@pytest.fixture
def s3(request):
    """A fresh bucket on the S3 server (moto, or radosgw when parametrized so), with the AWS_* variables
    naming its credentials; yields (base URL, storage_options)."""
    return _s3_bucket(request, getattr(request, "param", "moto"))


def _s3_bucket(request, server: str):
    monkeypatch = request.getfixturevalue("monkeypatch")
    bucket = _bucket_name(request)
    if server == "radosgw":
        gateway = request.getfixturevalue("radosgw")
        key, secret, endpoint = gateway.storage_options["key"], gateway.storage_options["secret"], gateway.endpoint
    else:
        key, secret, endpoint = "testing", "testing", request.getfixturevalue("moto_server")
    for name, value in {
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    options = {"client_kwargs": {"endpoint_url": endpoint}, "key": key, "secret": secret}
    s3_client(options).create_bucket(Bucket=bucket)
    return f"s3://{bucket}", options


def s3_client(options: dict):
    """A boto3 client for the server and credentials of ``storage_options``."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=options["client_kwargs"]["endpoint_url"],
        aws_access_key_id=options["key"],
        aws_secret_access_key=options["secret"],
        region_name="us-east-1",
    )


def s3_objects(options: dict, url: str) -> dict[str, int]:
    """Every object under ``url``: key -> size."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    listing = s3_client(options).list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: o["Size"] for o in listing}


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CKPTIO_"):
            monkeypatch.delenv(name)


@pytest.fixture
def s3_proxy(s3):
    """The fault-injecting proxy in front of the ``s3`` fixture's server (moto unless parametrized);
    yields (proxy, base URL, storage_options via the proxy)."""
    from ckptio.storage import s3_checksums
    from tests.helpers.faultproxy import FaultProxy

    base, direct = s3
    proxy = FaultProxy(direct["client_kwargs"]["endpoint_url"])
    # What ckptio learned of an earlier proxy on the same (reused) loopback port is not this server's:
    # a test counting the first upload's requests saw one request fewer when a port came round again.
    s3_checksums._endpoints.pop(proxy.url, None)
    s3_checksums._endpoints.pop(proxy.url.rstrip("/"), None)
    yield proxy, base, {**direct, "client_kwargs": {"endpoint_url": proxy.url}}
    proxy.close()


@pytest.fixture
def store_proxy(store):
    """The fault-injecting proxy in front of the ``store`` fixture's server (any of ``STORES``); yields
    (proxy, base URL, storage_options via the proxy)."""
    from ckptio.storage import s3_checksums
    from tests.helpers.faultproxy import FaultProxy

    base, direct = store
    if "client_kwargs" in direct:  # S3
        upstream = direct["client_kwargs"]["endpoint_url"]
    elif "endpoint_url" in direct:  # GCS
        upstream = direct["endpoint_url"]
    else:  # Azure: the connection string's blob endpoint
        upstream = direct["connection_string"].split("BlobEndpoint=")[1].split(";")[0]
    proxy = FaultProxy(upstream)
    s3_checksums._endpoints.pop(proxy.url, None)  # see s3_proxy
    s3_checksums._endpoints.pop(proxy.url.rstrip("/"), None)
    if "client_kwargs" in direct:
        options = {**direct, "client_kwargs": {"endpoint_url": proxy.url}}
    elif "endpoint_url" in direct:
        options = {**direct, "endpoint_url": proxy.url}
    else:
        endpoint = upstream.split("://", 1)[1].split("/", 1)[0]
        options = {"connection_string": direct["connection_string"].replace(endpoint, proxy.url.split("://")[1])}
    yield proxy, base, options
    proxy.close()


class _RadosgwStartup:
    """radosgw's cluster starts in ~12 s, mostly waiting on its daemons: started in a thread as soon as
    collection shows a test that needs it, it comes up while the first tests run."""

    def __init__(self) -> None:
        from benchmarks import radosgw as rgw

        def start() -> None:
            try:
                self.result = rgw.start()
            except rgw.Unavailable as exc:
                self.result = exc

        self.result: object = None
        self.thread = threading.Thread(target=start, name="radosgw-startup", daemon=True)
        self.thread.start()

    def get(self):
        self.thread.join()
        return self.result


_radosgw_startup: _RadosgwStartup | None = None


def pytest_collection_modifyitems(config, items):
    """Tests that need radosgw run last (in their order), so its cluster starts while the others run."""
    global _radosgw_startup

    def needs_radosgw(item) -> bool:
        params = getattr(getattr(item, "callspec", None), "params", {})
        return "radosgw" in getattr(item, "fixturenames", ()) or "radosgw" in (params.get("s3"), params.get("store"))

    on_radosgw = [item for item in items if needs_radosgw(item)]
    if on_radosgw:
        items[:] = [item for item in items if not needs_radosgw(item)] + on_radosgw
        if _radosgw_startup is None:
            _radosgw_startup = _RadosgwStartup()


def pytest_sessionfinish(session):
    if _radosgw_startup is not None:
        gateway = _radosgw_startup.get()
        if not isinstance(gateway, Exception):
            gateway.stop()


@pytest.fixture(scope="session")
def radosgw():
    """A Ceph radosgw on 127.0.0.1 with a one-node in-memory cluster, for the session (benchmarks/radosgw.py);
    skips, saying why, where it cannot run (``make radosgw`` installs its Debian packages)."""
    gateway = _radosgw_startup.get() if _radosgw_startup is not None else None
    if gateway is None or isinstance(gateway, Exception):
        pytest.skip(f"Ceph radosgw unavailable: {gateway}")
    return gateway


@pytest.fixture
def raw_checkpoint(tmp_path):
    """A small checkpoint with every item in a data file, and its stored (version 4) document."""
    import torch

    import ckptio
    from tests.helpers.documents import read_stored_doc

    url = str(tmp_path / "ckpt")
    state = {"w": torch.arange(20000.0), "b": torch.arange(7), "step": 3}
    ckptio.save(state, url, ckptio.WriterConfig(tuning=ckptio.Tuning(inline_limit=0)))
    doc = read_stored_doc(url)
    assert doc["format_version"] == 8
    return url, doc
