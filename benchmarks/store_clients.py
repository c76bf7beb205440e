"""``python -m ckptio.bench.store_clients``: what a GCS or Azure Blob client library costs the client, per GiB,
for the transfers a checkpoint makes (``s3_clients.py``'s measurement, for the other object stores): one
large object uploaded as parts written a block at a time, then read back in ranged GETs into memory the
caller holds. Against fake-gcs-server and Azurite, started by this run on 127.0.0.1.

GCS: ckptio's store (``ckptio/storage/gcs.py``: JSON-API requests over gcsfs's session, parallel parts
composed), gcsfs's file API (as torch's ``FsspecWriter``/``FsspecReader`` use it), the official
``google-cloud-storage`` client (its transfer manager, in threads) and obstore. Azure: ckptio's store
(``ckptio/storage/azure.py``: azure-storage-blob's async client, blocks staged in parallel), adlfs's file
API, the official synchronous ``azure-storage-blob`` client (``max_concurrency``) and obstore. Each client
runs in a process of its own; a client whose library is missing is skipped."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile

from . import emulators, usage_error
from .s3_clients import CONCURRENCY, WRITE_BYTES, _ranges, table, timed_transfers
from .workload import parse_size

CLIENTS = {
    "gcs": ("ckptio", "gcsfs", "google-cloud-storage", "obstore"),
    "azure": ("ckptio", "adlfs", "azure-storage-blob", "obstore"),
}
BUCKET = "ckptio-clients"


def _options(server: dict) -> dict:
    if server["store"] == "gcs":
        return emulators.gcs_options(server["endpoint"])
    return emulators.azure_options(server["connection_string"])


def _url(server: dict, key: str) -> str:
    return f"{'gs' if server['store'] == 'gcs' else 'az'}://{BUCKET}/{key}"


class _Ckptio:
    def __init__(self, server: dict, part: int):
        from ckptio.config import StorageConfig
        from ckptio.storage import open_store

        self.store = open_store(_url(server, "ckptio"), _options(server), StorageConfig(part_size=part))

    def upload(self, key: str, data: memoryview) -> None:
        from ckptio.format.codec import checksum

        sink = self.store.open_sink(key)
        for at in range(0, len(data), WRITE_BYTES):  # each block with its CRC32C, as a save encodes it
            block = data[at : at + WRITE_BYTES]
            sink.write(block, checksum(block))
        sink.close()

    def download(self, key: str, out: memoryview) -> None:
        from ckptio.storage import ReadRequest

        starts, ends = _ranges(len(out))
        self.store.read_into([ReadRequest(key, a, (out[a:z],)) for a, z in zip(starts, ends, strict=True)])


class _Fsspec:
    """gcsfs or adlfs as torch's FsspecWriter writes (a stream of writes) and its reader reads."""

    def __init__(self, server: dict, part: int):
        import fsspec

        self.server, self.part = server, part
        self.fs = fsspec.filesystem("gcs" if server["store"] == "gcs" else "az", **_options(server))

    def upload(self, key: str, data: memoryview) -> None:
        with self.fs.open(_url(self.server, f"fsspec/{key}"), "wb", block_size=self.part) as f:
            for at in range(0, len(data), WRITE_BYTES):
                f.write(data[at : at + WRITE_BYTES])

    def download(self, key: str, out: memoryview) -> None:
        starts, ends = _ranges(len(out))
        path = _url(self.server, f"fsspec/{key}")
        for start, body in zip(starts, self.fs.cat_ranges([path] * len(starts), starts, ends), strict=True):
            out[start : start + len(body)] = body


class _GoogleCloudStorage:
    def __init__(self, server: dict, part: int):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        client = storage.Client(
            project="ckptio-test",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": server["endpoint"]},
        )
        self.bucket, self.part = client.bucket(BUCKET), part

    def upload(self, key: str, data: memoryview) -> None:
        # a resumable upload in part-sized chunks, one stream (its parallel upload, transfer_manager's
        # upload_chunks_concurrently, needs the XML multipart API, which fake-gcs-server does not serve)
        blob = self.bucket.blob(f"gcs/{key}", chunk_size=self.part)
        blob.upload_from_file(io.BytesIO(data), size=len(data), checksum="crc32c")

    def download(self, key: str, out: memoryview) -> None:
        starts, ends = _ranges(len(out))
        blob = self.bucket.blob(f"gcs/{key}")
        for start, end in zip(starts, ends, strict=True):
            body = blob.download_as_bytes(start=start, end=end - 1, checksum=None)
            out[start : start + len(body)] = body


class _AzureStorageBlob:
    def __init__(self, server: dict, part: int):
        from azure.storage.blob import BlobServiceClient

        service = BlobServiceClient.from_connection_string(
            server["connection_string"], max_block_size=part, max_single_put_size=part
        )
        self.container = service.get_container_client(BUCKET)

    def upload(self, key: str, data: memoryview) -> None:
        self.container.get_blob_client(f"blob/{key}").upload_blob(
            bytes(data), overwrite=True, max_concurrency=CONCURRENCY, validate_content=True
        )

    def download(self, key: str, out: memoryview) -> None:
        starts, ends = _ranges(len(out))
        blob = self.container.get_blob_client(f"blob/{key}")
        for start, end in zip(starts, ends, strict=True):
            body = blob.download_blob(offset=start, length=end - start, max_concurrency=CONCURRENCY).readall()
            out[start : start + len(body)] = body


class _Obstore:
    def __init__(self, server: dict, part: int):
        from obstore.store import AzureStore, GCSStore

        self.part = part
        if server["store"] == "gcs":  # object_store's test hooks for fake-gcs-server: a base URL, no OAuth
            account = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
            json.dump({"gcs_base_url": server["endpoint"], "disable_oauth": True, "client_email": "", "private_key": "",
                       "private_key_id": ""}, account)  # fmt: skip
            account.close()
            self.store = GCSStore(BUCKET, service_account_path=account.name, client_options={"allow_http": True})
        else:
            endpoint = server["connection_string"].split("BlobEndpoint=")[1].split(";")[0]
            self.store = AzureStore(
                BUCKET,
                account_name=emulators.AZURITE_ACCOUNT,
                account_key=emulators.AZURITE_KEY,
                endpoint=endpoint,
                client_options={"allow_http": True},
            )

    def upload(self, key: str, data: memoryview) -> None:
        import obstore

        obstore.put(self.store, f"obstore/{key}", data, chunk_size=self.part, max_concurrency=CONCURRENCY)

    def download(self, key: str, out: memoryview) -> None:
        import obstore

        starts, ends = _ranges(len(out))
        bodies = obstore.get_ranges(self.store, f"obstore/{key}", starts=starts, ends=ends, coalesce=0)
        for start, body in zip(starts, bodies, strict=True):
            out[start : start + len(body)] = memoryview(body)


IMPLEMENTATIONS = {
    "ckptio": _Ckptio,
    "gcsfs": _Fsspec,
    "adlfs": _Fsspec,
    "google-cloud-storage": _GoogleCloudStorage,
    "azure-storage-blob": _AzureStorageBlob,
    "obstore": _Obstore,
}


def measure_one(client: str, server: dict, size: int, part: int, repeats: int) -> dict:
    """In this process: ``repeats`` uploads and downloads with ``client`` (one untimed first)."""
    return {"client": client, **timed_transfers(IMPLEMENTATIONS[client](server, part), size, repeats)}


@contextlib.contextmanager
def _servers(stores: list[str]):
    with contextlib.ExitStack() as stack:
        servers = {}
        if "gcs" in stores:
            endpoint = stack.enter_context(emulators.local_gcs_server())
            emulators.create_gcs_bucket(endpoint, BUCKET)
            servers["fake-gcs-server"] = {"store": "gcs", "endpoint": endpoint}
        if "azure" in stores:
            connection_string = stack.enter_context(emulators.local_azure_server())
            emulators.create_azure_container(connection_string, BUCKET)
            servers["Azurite"] = {"store": "azure", "connection_string": connection_string}
        yield servers


def _measure(client: str, server: dict, size: int, part: int, repeats: int) -> dict:
    """``measure_one`` in a process of its own; a failure is a row that says why."""
    spec = dict(client=client, server=server, size=size, part=part, repeats=repeats)
    done = subprocess.run(
        [sys.executable, "-m", "ckptio.bench.store_clients", "--one"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        env={**os.environ, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"},
    )
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["failed"])[-1][:200]
        return {"client": client, "skipped": f"failed: {reason}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptio.bench.store_clients", description=__doc__)
    p.add_argument("--size", default="256MiB", help="object size (default 256MiB)")
    p.add_argument("--part-size", default="32MiB", help="upload part size (default 32MiB, ckptio's)")
    p.add_argument("--repeats", type=int, default=5, help="timed transfers per client (default 5)")
    p.add_argument("--stores", nargs="+", choices=sorted(CLIENTS), default=sorted(CLIENTS))
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # internal: one client, spec on stdin
    args = p.parse_args(argv)
    if args.repeats < 1:
        usage_error("--repeats takes at least 1")
    if args.one:
        print(json.dumps(measure_one(**json.load(sys.stdin))))
        return 0
    size, part = parse_size(args.size), parse_size(args.part_size)
    rows = []
    try:
        with _servers(args.stores) as servers:
            for server_name, server in servers.items():
                for client in CLIENTS[server["store"]]:
                    rows.append({"server": server_name, **_measure(client, server, size, part, args.repeats)})
                    print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    except emulators.Unavailable as exc:
        usage_error(str(exc))
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
