import os

import pytest


@pytest.fixture(scope="session")
def moto_server():
    """A moto S3 server on 127.0.0.1 (real HTTP), shared by the session; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server._server.port}"
    yield endpoint
    server.stop()


@pytest.fixture
def s3(moto_server, monkeypatch, request):
    """A fresh bucket on the moto server; yields (base URL, storage_options)."""
    import boto3

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    bucket = "ckptio-" + request.node.name.lower().replace("[", "-").replace("]", "").replace("_", "-")[:40]
    boto3.client("s3", endpoint_url=moto_server).create_bucket(Bucket=bucket)
    options = {"client_kwargs": {"endpoint_url": moto_server}, "key": "testing", "secret": "testing"}
    return f"s3://{bucket}", options


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CKPTIO_"):
            monkeypatch.delenv(name)
