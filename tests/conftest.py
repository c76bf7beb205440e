from __future__ import annotations

import hashlib
import os
import threading

import pytest


@pytest.fixture(scope="session")
def moto_server():
    """A moto S3 server on 127.0.0.1 (real HTTP), shared by the session; yields its endpoint URL."""
    from ckptio.bench.s3server import local_s3_server

    with local_s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3(moto_server, monkeypatch, request):
    """A fresh bucket on the moto server; yields (base URL, storage_options)."""
    import boto3

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:10]
    bucket = f"ckptio-{request.node.originalname.lower().replace('_', '-')[:40]}-{digest}"
    boto3.client("s3", endpoint_url=moto_server).create_bucket(Bucket=bucket)
    options = {"client_kwargs": {"endpoint_url": moto_server}, "key": "testing", "secret": "testing"}
    return f"s3://{bucket}", options


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CKPTIO_"):
            monkeypatch.delenv(name)


@pytest.fixture
def s3_proxy(s3, moto_server):
    """The fault-injecting proxy in front of moto; yields (proxy, base URL, storage_options via proxy)."""
    from .faultproxy import FaultProxy

    base, _ = s3
    proxy = FaultProxy(moto_server)
    options = {"client_kwargs": {"endpoint_url": proxy.url}, "key": "testing", "secret": "testing"}
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
    global _radosgw_startup
    if _radosgw_startup is None and any("radosgw" in getattr(item, "fixturenames", ()) for item in items):
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
