"""An HTTP proxy on 127.0.0.1 in front of the S3 server: counts requests by S3 operation and
bytes, and fails chosen requests (503 SlowDown, 500 InternalError, dropped connection) or damages
them in flight (one byte of the body flipped). ``PrefixRateLimit`` throttles as S3 does: 503
SlowDown to requests above a rate per key prefix. ``stats.peak_in_flight`` is the most requests
it held at once. With ``check_crc32c`` it also does what AWS S3 does
with a request's ``x-amz-checksum-crc32c`` (moto and radosgw 16 ignore it): refuses a body that does
not match it (400 BadDigest) and echoes it in the answer."""

from __future__ import annotations

import base64
import collections
import http.client
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import parse_qs, urlsplit

import crc32c

STALL_S = 30.0
ERROR_BODIES = {
    503: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code><Message>Please reduce your request "
    b"rate.</Message></Error>",
    403: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code><Message>Access Denied</Message>"
    b"</Error>",
    500: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code><Message>We encountered an "
    b"internal error. Please try again.</Message></Error>",
    429: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>TooManyRequests</Code><Message>Too many requests."
    b"</Message></Error>",
    501: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NotImplemented</Code><Message>A header you provided "
    b"implies functionality that is not implemented.</Message></Error>",
    400: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InvalidArgument</Code><Message>Unsupported header "
    b"'x-amz-checksum-crc32c' received for this API call.</Message></Error>",
}
BAD_DIGEST = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>BadDigest</Code><Message>The CRC32C you specified did not "
    b"match the calculated checksum.</Message></Error>"
)


def _crc32c_header(body: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(body).to_bytes(4, "big")).decode()


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict
    operation: str
    key: str
    conditional: bool = False  # an If-None-Match / If-Match request, or GCS's ifGenerationMatch
    checksum: bool = False  # it carries x-amz-checksum-crc32c (a part, a PUT) or x-amz-checksum-algorithm
    signed_payload: bool = False  # its x-amz-content-sha256 is the payload's hash (not UNSIGNED-PAYLOAD)
    range: str = ""  # a ranged GET's Range header


def classify(method: str, target: str, headers) -> Request:
    parts = urlsplit(target)
    query = parse_qs(parts.query, keep_blank_values=True)
    path = parts.path.lstrip("/")
    bucket, _, key = path.partition("/")
    if method == "PUT":
        op = (
            "COPY"
            if "x-amz-copy-source" in headers
            else ("MPU_PART" if "partNumber" in query else ("CREATE_BUCKET" if not key else "PUT"))
        )
    elif method == "POST":
        op = (
            "MPU_CREATE"
            if "uploads" in query
            else ("MPU_COMPLETE" if "uploadId" in query else ("DELETE" if "delete" in query else "POST"))
        )
    elif method == "DELETE":
        op = "MPU_ABORT" if "uploadId" in query else "DELETE"
    elif method == "GET":
        op = (
            "LIST_MPU"
            if "uploads" in query
            else ("LIST" if not key or "list-type" in query or "prefix" in query else "GET")
        )
    elif method == "HEAD":
        op = "HEAD"
    else:
        op = method
    conditional = any(h in headers for h in ("If-None-Match", "If-Match")) or "ifGenerationMatch" in query
    checksum = any(h in headers for h in ("x-amz-checksum-crc32c", "x-amz-checksum-algorithm"))
    signed = len(headers.get("x-amz-content-sha256", "")) == 64
    return Request(method, path, query, op, key, conditional, checksum, signed, headers.get("Range", ""))


@dataclass
class Fault:
    """Fail exactly ``fraction`` of the requests that ``match`` (evenly spread, so runs are
    reproducible), at most ``times`` times."""

    match: Callable[[Request], bool]
    # 503, 501, 500, 429, 403, 400, "drop", "stall", "flip", "ignore_range" (forwarded without its Range header)
    # or "ignore_precondition" (a create-only write that succeeds over an existing object); a list is cycled through
    action: int | str | list
    fraction: float = 1.0
    times: int | None = None
    hits: int = 0
    seen: int = 0

    def fires(self, req: Request) -> bool:
        if (self.times is not None and self.hits >= self.times) or not self.match(req):
            return False
        self.seen += 1
        return int(self.seen * self.fraction) > int((self.seen - 1) * self.fraction)


def key_folder(req: Request) -> str:
    """The partition S3 would put a request in, as a folder: its bucket and key up to the last '/'."""
    return req.path.rpartition("/")[0]


@dataclass
class PrefixRateLimit:
    """503 SlowDown for the requests into a partition (``partition(req)``) beyond ``rate`` per
    second on average, ``burst`` at once (a token bucket per partition; refused requests take no
    token), as S3 answers a prefix's request rate above what its partitions serve."""

    rate: float
    burst: float
    partition: Callable[[Request], str] = key_folder
    action: int = 503
    times: int | None = None
    hits: int = 0
    buckets: dict = field(default_factory=dict)  # partition -> (tokens, when last counted)

    def fires(self, req: Request) -> bool:
        now = time.monotonic()
        where = self.partition(req)
        tokens, last = self.buckets.get(where, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        refused = tokens < 1
        self.buckets[where] = (tokens if refused else tokens - 1, now)
        return refused


@dataclass
class Stats:
    requests: collections.Counter = field(default_factory=collections.Counter)
    failed: collections.Counter = field(default_factory=collections.Counter)
    get_bytes: collections.Counter = field(default_factory=collections.Counter)  # key -> response bytes
    answers: collections.Counter = field(default_factory=collections.Counter)  # (operation, status) from the store
    log: list = field(default_factory=list)
    peak_in_flight: int = 0


class FaultProxy:
    def __init__(self, upstream: str):
        up = urlsplit(upstream)
        self.upstream = (up.hostname, up.port)
        self.faults: list[Fault] = []
        self.check_crc32c = False
        self.stats = Stats()
        self.in_flight = 0
        self.lock = threading.Lock()
        self.closing = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                with proxy.lock:
                    proxy.in_flight += 1
                    proxy.stats.peak_in_flight = max(proxy.stats.peak_in_flight, proxy.in_flight)
                try:
                    self._answer()
                finally:
                    with proxy.lock:
                        proxy.in_flight -= 1

            def _answer(self):
                body = self._read_body()
                req = classify(self.command, self.path, self.headers)
                action = proxy._decide(req)
                if action == "stall":  # accept the request, never answer (bounded, so the test ends)
                    proxy.closing.wait(STALL_S)
                    action = "drop"
                if action == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action == "flip" and body:
                    body = bytearray(body)
                    body[len(body) // 2] ^= 0x01
                    body = bytes(body)
                sent_crc = self.headers.get("x-amz-checksum-crc32c")
                if proxy.check_crc32c and sent_crc is not None and sent_crc != _crc32c_header(body):
                    action = "bad_digest"
                if action in ERROR_BODIES or action == "bad_digest":
                    payload = BAD_DIGEST if action == "bad_digest" else ERROR_BODIES[action]
                    self.send_response(400 if action == "bad_digest" else action)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                target, drop = self.path, ("range",) if action == "ignore_range" else ()
                if action == "ignore_precondition":  # as a store that does not implement it
                    target = re.sub(r"[?&]ifGenerationMatch=0", "", target)
                status, headers, data = proxy._forward(self.command, target, self.headers, body, drop=drop)
                if action == "ignore_precondition" and status in (409, 412):
                    # If-None-Match is signed (Azure, S3): it reaches the store, whose refusal is hidden
                    status, headers, data = 201, [("Content-Type", "application/octet-stream")], b""
                with proxy.lock:
                    proxy.stats.answers[req.operation, status] += 1
                if req.operation == "GET" and status in (200, 206):
                    with proxy.lock:
                        proxy.stats.get_bytes[req.key] += len(data)
                self.send_response(status)
                if proxy.check_crc32c and sent_crc is not None and status == 200:
                    headers = [*headers, ("x-amz-checksum-crc32c", sent_crc)]
                for name, value in headers:
                    if name.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(name, value)
                # a HEAD answer has no body, but its Content-Length is the object's size
                length = dict((k.lower(), v) for k, v in headers).get("content-length", "0")
                self.send_header("Content-Length", length if self.command == "HEAD" else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _decide(self, req: Request):
        with self.lock:
            self.stats.requests[req.operation] += 1
            self.stats.log.append(req)
            for fault in self.faults:
                if fault.fires(req):
                    action = (
                        fault.action[fault.hits % len(fault.action)] if isinstance(fault.action, list) else fault.action
                    )
                    fault.hits += 1
                    self.stats.failed[req.operation] += 1
                    return action
        return None

    def _forward(self, method: str, target: str, headers, body: bytes, drop: tuple[str, ...] = ()):
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in headers.items():
                if name.lower() not in ("transfer-encoding", "content-length", "connection", *drop):
                    conn.putheader(name, value)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders()
            if body:
                conn.send(body)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, resp.getheaders(), data
        finally:
            conn.close()

    def reset(self) -> Stats:
        with self.lock:
            stats, self.stats = self.stats, Stats()
            self.faults = []
        return stats

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()
