"""How an S3 upload's bytes are checked on their way to the store: each PUT and each part carries its
CRC32C (``x-amz-checksum-crc32c``), combined from the CRC32Cs ckptio keeps of every block (no second
pass over the bytes), and the client computes no checksum of its own; the payload goes unsigned (no
SHA-256 pass) wherever the CRC32C is known to be checked: over TLS, or once the store has echoed a
CRC32C back (AWS S3 does; it then refuses a damaged part with ``BadDigest``, which is retried). Where
that is not known (plain HTTP to a store that does not echo, e.g. radosgw 16, which accepts and
ignores the header), the payload is SHA-256 signed, which every SigV4 store verifies. A store that
refuses the header gets uploads without it, signed, and one warning per endpoint.
"""

from __future__ import annotations

import base64
import logging
import threading
from typing import Any, Sequence

from ckptio.format.codec import checksum_of_pieces
from ckptio.storage.retry import store_answer

log = logging.getLogger(__name__)

#: Error codes with which a store refuses a header it does not implement (a checksum mismatch is
#: ``BadDigest``, not one of these).
REFUSED_CODES = frozenset({"InvalidArgument", "InvalidRequest", "NotImplemented", "501", "400"})


def crc32c_header(pieces: Sequence[tuple[Any, int | None]]) -> str:
    """The value of ``x-amz-checksum-crc32c`` for ``(data, its CRC32C or None)`` pieces back to back:
    the CRC32Cs the encoder computed are combined, not computed again (``codec.checksum_of_pieces``)."""
    return base64.b64encode(checksum_of_pieces(pieces).to_bytes(4, "big")).decode("ascii")


class EndpointChecksums:
    """What one endpoint does with request checksums, learned from its answers (shared by every
    store of the process that talks to it)."""

    def __init__(self, endpoint: str, tls: bool):
        self.endpoint, self.tls = endpoint, tls
        self.refused = False  # it rejected the header: send none
        self.accepted = False  # it answered a request that carried one
        self.echoed = False  # it answered with our CRC32C: it checks them

    @property
    def send_crc32c(self) -> bool:
        return not self.refused

    @property
    def unsigned_payload(self) -> bool:
        """Whether a request carrying the CRC32C may skip the SHA-256 payload signature."""
        return self.tls or self.echoed

    def observe(self, response: dict, sent: str | None) -> None:
        self.accepted = True
        if sent is not None and not self.echoed and response.get("ChecksumCRC32C") == sent:
            self.echoed = True

    def refusal(self, exc: BaseException) -> str | None:
        """What ``exc`` says if it may be the store refusing the header (``None`` otherwise); the
        caller retries without it and calls ``refused_by`` only if that succeeds, so an error some
        other header caused changes nothing."""
        answer = store_answer(exc)
        if self.accepted or answer is None:
            return None
        code, status = answer
        return f"{status} {code}" if code in REFUSED_CODES or status == 501 else None

    def refused_by(self, answer: str) -> None:
        with _lock:
            if not self.refused:
                self.refused = True
                log.warning(
                    "ckptio: %s refused CRC32C request checksums (%s); uploads to it go without them, their payload "
                    "SHA-256 signed (which the store verifies instead)",
                    self.endpoint,
                    answer,
                )


_lock = threading.Lock()
_endpoints: dict[str, EndpointChecksums] = {}


def for_endpoint(endpoint: str) -> EndpointChecksums:
    """The process-wide record for ``endpoint`` (a URL; empty for AWS's own endpoints)."""
    with _lock:
        found = _endpoints.get(endpoint)
        if found is None:
            found = _endpoints[endpoint] = EndpointChecksums(endpoint or "AWS S3", not endpoint.startswith("http:"))
        return found
