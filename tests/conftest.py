import hashlib
import os

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


@pytest.fixture(scope="session")
def radosgw():
    """A Ceph radosgw on 127.0.0.1 with a one-node in-memory cluster, for the session (tests/radosgw.py);
    skips, saying why, where it cannot run (``make radosgw`` installs its Debian packages)."""
    from . import radosgw as rgw

    try:
        gateway = rgw.start()
    except rgw.Unavailable as exc:
        pytest.skip(f"Ceph radosgw unavailable: {exc}")
    yield gateway
    gateway.stop()
