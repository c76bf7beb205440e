"""An S3 server on 127.0.0.1 (moto), for the embedded benchmark default and the tests."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def local_s3_server() -> Iterator[str]:
    """Start moto on a free loopback port; yield its endpoint URL."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{server._server.port}"
    finally:
        server.stop()


def create_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    ).create_bucket(Bucket=bucket)


def use_test_credentials() -> None:
    for key, value in CREDENTIALS.items():
        os.environ.setdefault(key, value)
