"""``python -m ckptio.bench.s3_clients``: what an S3 client library costs the client, per GiB, for
the transfers a checkpoint makes: one large object uploaded in parts, then read back in ranged GETs
into memory the caller holds (as a load reads into tensors).

Clients: ckptio's own S3 path (s3fs's aiobotocore client, ``ckptio/storage/s3.py``), s3fs as
torch's ``FsspecWriter``/``FsspecReader`` use it, obstore (Rust ``object_store``) and the AWS CRT
(``awscrt``). Each runs in a process of its own: botocore picks its request signer when it is
imported, and with awscrt installed it signs through the CRT (``BOTO_DISABLE_CRT=true`` here keeps its
own signer, as without awscrt). Each transfer is measured with the
payload SHA-256 signed (what plain-HTTP stores that check no CRC32C need) and unsigned (TLS), where
the client can do both. Clients whose library is missing are skipped (``pip install
'ckptio[clients]'``). Against the embedded moto server by default, ``--radosgw`` (a Ceph radosgw
this run starts) or ``--endpoint-url`` with ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any, Callable

from . import usage_error
from .workload import parse_size

CLIENTS = ("ckptio", "s3fs", "obstore", "awscrt")
#: A checkpoint's writes arrive at the client in blocks of this size (ckptio's default block).
WRITE_BYTES = 256 << 10
#: Ranged GETs of this size (ckptio's longest request).
RANGE_BYTES = 32 << 20
CONCURRENCY = 8
BUCKET = "ckptio-clients"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process, native ones too
    return usage.ru_utime + usage.ru_stime


class _Client:
    """Upload ``data`` as one object in parts of ``part`` bytes; download it into ``out`` in ranges."""

    def __init__(self, server: dict, signed: bool, part: int):
        self.server, self.signed, self.part = server, signed, part

    def upload(self, key: str, data: memoryview) -> None:
        raise NotImplementedError

    def download(self, key: str, out: memoryview) -> None:
        raise NotImplementedError


class _Ckptio(_Client):
    def __init__(self, *args):
        super().__init__(*args)
        from ckptio.config import StorageConfig
        from ckptio.storage import open_store

        options = _botocore_options(self.server, self.signed)
        self.store = open_store(f"s3://{BUCKET}/ckptio", options, StorageConfig(part_size=self.part))

    def upload(self, key, data):
        from ckptio.format.codec import checksum

        sink = self.store.open_sink(key)
        for at in range(0, len(data), WRITE_BYTES):  # each block with its CRC32C, as a save encodes it
            block = data[at : at + WRITE_BYTES]
            sink.write(block, checksum(block))
        sink.close()

    def download(self, key, out):
        from ckptio.storage import ReadRequest

        starts, ends = _ranges(len(out))
        self.store.read_into([ReadRequest(key, a, (out[a:z],)) for a, z in zip(starts, ends, strict=True)])


class _S3fs(_Client):
    """As torch's FsspecWriter writes (a stream of writes) and its reader reads (bytes, then copied)."""

    def __init__(self, *args):
        super().__init__(*args)
        import s3fs

        self.fs = s3fs.S3FileSystem(**_botocore_options(self.server, self.signed), skip_instance_cache=True)

    def upload(self, key, data):
        with self.fs.open(f"{BUCKET}/s3fs/{key}", "wb", block_size=self.part) as f:
            for at in range(0, len(data), WRITE_BYTES):
                f.write(data[at : at + WRITE_BYTES])

    def download(self, key, out):
        starts, ends = _ranges(len(out))
        bodies = self.fs.cat_ranges([f"{BUCKET}/s3fs/{key}"] * len(starts), starts, ends)
        for start, body in zip(starts, bodies, strict=True):
            out[start : start + len(body)] = body


class _Obstore(_Client):
    def __init__(self, *args):
        super().__init__(*args)
        from obstore.store import S3Store

        self.store = S3Store(
            BUCKET,
            endpoint=self.server["endpoint"],
            access_key_id=self.server["key"],
            secret_access_key=self.server["secret"],
            region="us-east-1",
            virtual_hosted_style_request=False,
            unsigned_payload=not self.signed,
            client_options={"allow_http": True},
        )

    def upload(self, key, data):
        import obstore

        obstore.put(self.store, f"obstore/{key}", data, chunk_size=self.part, max_concurrency=CONCURRENCY)

    def download(self, key, out):
        import obstore

        starts, ends = _ranges(len(out))
        bodies = obstore.get_ranges(self.store, f"obstore/{key}", starts=starts, ends=ends, coalesce=0)
        for start, body in zip(starts, bodies, strict=True):
            out[start : start + len(body)] = memoryview(body)


class _Awscrt(_Client):
    """The CRT's S3 client splits and parallelizes uploads and downloads itself (parts of ``part``)."""

    def __init__(self, *args):
        super().__init__(*args)
        from awscrt import auth, s3
        from awscrt import io as crt_io

        group = crt_io.EventLoopGroup()
        bootstrap = crt_io.ClientBootstrap(group, crt_io.DefaultHostResolver(group))
        credentials = auth.AwsCredentialsProvider.new_static(self.server["key"], self.server["secret"])
        signing = auth.AwsSigningConfig(
            algorithm=auth.AwsSigningAlgorithm.V4,
            signature_type=auth.AwsSignatureType.HTTP_REQUEST_HEADERS,
            service="s3",
            region="us-east-1",
            credentials_provider=credentials,
            signed_body_header_type=auth.AwsSignedBodyHeaderType.X_AMZ_CONTENT_SHA_256,
            signed_body_value=None if self.signed else auth.AwsSignedBodyValue.UNSIGNED_PAYLOAD,
            use_double_uri_encode=False,
            should_normalize_uri_path=False,
        )
        tls = (
            s3.S3RequestTlsMode.DISABLED if self.server["endpoint"].startswith("http:") else s3.S3RequestTlsMode.ENABLED
        )
        self.s3 = s3
        self.host = self.server["endpoint"].split("://", 1)[1].rstrip("/")
        self.client = s3.S3Client(
            bootstrap=bootstrap, region="us-east-1", signing_config=signing, tls_mode=tls, part_size=self.part
        )

    def _request(self, method, key, request_type, headers=(), body=None, on_body=None):
        from awscrt import http

        headers = http.HttpHeaders([("Host", self.host), *headers])
        request = http.HttpRequest(method, f"/{BUCKET}/awscrt/{key}", headers, body)
        done = self.client.make_request(type=request_type, request=request, on_body=on_body)
        done.finished_future.result()

    def upload(self, key, data):
        stream = _ViewStream(data)
        self._request("PUT", key, self.s3.S3RequestType.PUT_OBJECT, [("Content-Length", str(len(data)))], stream)

    def download(self, key, out):
        def on_body(chunk, offset, **_):
            out[offset : offset + len(chunk)] = chunk

        self._request("GET", key, self.s3.S3RequestType.GET_OBJECT, on_body=on_body)


class _ViewStream(io.RawIOBase):
    """A request body read from memory the caller holds (``io.BytesIO`` would copy it first)."""

    def __init__(self, view: memoryview):
        self.view, self.at = view, 0

    def readable(self):
        return True

    def readinto(self, buffer):
        n = min(len(buffer), len(self.view) - self.at)
        buffer[:n] = self.view[self.at : self.at + n]
        self.at += n
        return n


IMPLEMENTATIONS = {"ckptio": _Ckptio, "s3fs": _S3fs, "obstore": _Obstore, "awscrt": _Awscrt}
#: The library each client needs beyond ckptio's own dependencies.
LIBRARIES = {"obstore": "obstore", "awscrt": "awscrt"}


def _botocore_options(server: dict, signed: bool) -> dict:
    options = {"key": server["key"], "secret": server["secret"], "client_kwargs": {"endpoint_url": server["endpoint"]}}
    options["config_kwargs"] = {"s3": {"payload_signing_enabled": signed}}
    return options


def _ranges(size: int) -> tuple[list[int], list[int]]:
    """Starts and ends of the ranged GETs that read ``size`` bytes."""
    starts = list(range(0, size, RANGE_BYTES))
    return starts, [min(start + RANGE_BYTES, size) for start in starts]


def measure_one(client: str, server: dict, size: int, part: int, repeats: int, signed: bool) -> dict:
    """In this process: ``repeats`` uploads and downloads with ``client`` (one untimed first)."""

    impl = IMPLEMENTATIONS[client](server, signed, part)
    return {
        "client": client,
        "signed": signed,
        **timed_transfers(impl, size, repeats, lambda key: _delete(server, key)),
    }


def timed_transfers(impl: Any, size: int, repeats: int, delete: Callable[[str], None] | None = None) -> dict:
    """``repeats`` uploads and downloads of ``size`` random bytes through ``impl`` (one untimed first), each
    read back checked; CPU seconds per GiB and MB/s of each, median, min and max."""
    import numpy as np

    data = memoryview(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)).cast("B")
    out = memoryview(np.empty(size, dtype=np.uint8)).cast("B")
    rows = []
    for rep in range(repeats + 1):
        key = f"{uuid.uuid4().hex}"
        cpu, wall = _cpu(), time.monotonic()
        impl.upload(key, data)
        up_cpu, up_s = _cpu() - cpu, time.monotonic() - wall
        cpu, wall = _cpu(), time.monotonic()
        impl.download(key, out)
        down_cpu, down_s = _cpu() - cpu, time.monotonic() - wall
        if out != data:
            raise AssertionError(f"{type(impl).__name__}: the object read back differs from the one written")
        if delete is not None:
            delete(key)
        if rep:  # the first includes connection setup and imports on first use
            rows.append((up_cpu, up_s, down_cpu, down_s))
    gib = size / (1 << 30)

    def stat(values: list[float]) -> list[float]:
        return [statistics.median(values), min(values), max(values)]

    return {
        "upload_cpu_s_per_gib": stat([r[0] / gib for r in rows]),
        "upload_mb_s": stat([size / r[1] / 1e6 for r in rows]),
        "download_cpu_s_per_gib": stat([r[2] / gib for r in rows]),
        "download_mb_s": stat([size / r[3] / 1e6 for r in rows]),
    }


def _boto3(server: dict):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=server["endpoint"],
        aws_access_key_id=server["key"],
        aws_secret_access_key=server["secret"],
        region_name="us-east-1",
    )


def _delete(server: dict, key: str) -> None:
    """Remove what a repeat wrote (radosgw's store is memory), whichever client wrote it."""
    s3 = _boto3(server)
    for prefix in IMPLEMENTATIONS:
        s3.delete_object(Bucket=BUCKET, Key=f"{prefix}/{key}")


def _installed(client: str) -> bool:
    library = LIBRARIES.get(client)
    if library is None:
        return True
    import importlib.util

    return importlib.util.find_spec(library) is not None


@contextlib.contextmanager
def _servers(args: argparse.Namespace):
    """name -> {endpoint, key, secret}: the embedded moto server unless a target is given."""
    from .s3server import local_s3_server

    with contextlib.ExitStack() as stack:
        servers = {}
        if args.endpoint_url:
            key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
            if not key or not secret:
                usage_error("--endpoint-url needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
            servers["s3"] = {"endpoint": args.endpoint_url, "key": key, "secret": secret}
        if args.radosgw:
            from . import radosgw

            try:
                gateway = radosgw.start()
            except radosgw.Unavailable as exc:
                usage_error(f"--radosgw: {exc}")
            stack.callback(gateway.stop)
            options = gateway.storage_options
            servers["radosgw"] = {"endpoint": gateway.endpoint, "key": options["key"], "secret": options["secret"]}
        if not servers or args.moto:
            endpoint = stack.enter_context(local_s3_server())
            servers["moto"] = {"endpoint": endpoint, "key": "testing", "secret": "testing"}
        for server in servers.values():
            _create_bucket(server)
        yield servers


def _create_bucket(server: dict) -> None:
    s3 = _boto3(server)
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
        s3.create_bucket(Bucket=BUCKET)


def cell(values: list[float], digits: int) -> str:
    """``median (min-max)``."""
    return f"{values[0]:.{digits}f} ({values[1]:.{digits}f}-{values[2]:.{digits}f})"


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table; a payload column where rows say how the payload went (S3's)."""
    payload = any("signed" in r for r in rows)
    head = ["server", "client", *(["payload"] if payload else []), "upload CPU-s/GiB", "upload MB/s"]
    head += ["download CPU-s/GiB", "download MB/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["server"], r["client"]]
        if payload:
            cells.append(("SHA-256 signed" if r["signed"] else "unsigned") if "signed" in r else "-")
        if "skipped" in r:
            cells += [r["skipped"], "", "", ""]
        else:
            cells += [cell(r["upload_cpu_s_per_gib"], 2), cell(r["upload_mb_s"], 0)]
            cells += [cell(r["download_cpu_s_per_gib"], 2), cell(r["download_mb_s"], 0)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptio.bench.s3_clients", description=__doc__)
    p.add_argument("--size", default="512MiB", help="object size (default 512MiB)")
    p.add_argument("--part-size", default="32MiB", help="upload part size (default 32MiB, ckptio's)")
    p.add_argument("--repeats", type=int, default=5, help="timed transfers per client (default 5)")
    p.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    p.add_argument("--radosgw", action="store_true", help="measure against a Ceph radosgw this run starts")
    p.add_argument("--moto", action="store_true", help="also the embedded moto server (the default without targets)")
    p.add_argument("--endpoint-url", help="an S3 endpoint (credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # internal: one client, spec on stdin
    args = p.parse_args(argv)
    size, part = parse_size(args.size), parse_size(args.part_size)
    if args.repeats < 1:
        usage_error("--repeats takes at least 1")
    if args.one:  # the spec (credentials included) comes on stdin, not in the process list
        print(json.dumps(measure_one(**json.load(sys.stdin))))
        return 0
    rows = []
    with _servers(args) as servers:
        for server_name, server in servers.items():
            for client in args.clients:
                if not _installed(client):
                    rows.append({"server": server_name, "client": client, "skipped": f"not installed ({client})"})
                    continue
                for signed in (True, False):
                    spec = dict(client=client, server=server, size=size, part=part, repeats=args.repeats, signed=signed)
                    done = subprocess.run(
                        [sys.executable, "-m", "ckptio.bench.s3_clients", "--one"],
                        input=json.dumps(spec),
                        capture_output=True,
                        text=True,
                        env={**os.environ, "BOTO_DISABLE_CRT": "true"},  # botocore's own signer, as without awscrt
                    )
                    if done.returncode != 0:
                        reason = (done.stderr.strip().splitlines() or ["failed"])[-1][:200]
                        rows.append({"server": server_name, "client": client, "skipped": f"failed: {reason}"})
                        break
                    rows.append({"server": server_name, **json.loads(done.stdout.strip().splitlines()[-1])})
                    print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
