"""The one retry policy for object-store requests: exponential backoff with full jitter,
bounded in attempts and in total time, and only for errors that can succeed on a retry."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Awaitable, Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRYABLE_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "RequestTimeoutException",
    "Throttling",
    "ThrottlingException",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "BadDigest",
    "IncompleteBody",
    "XAmzContentSHA256Mismatch",
    "OperationTimedOut",  # Azure
    "Md5Mismatch",  # Azure: a block or blob damaged in flight
    "500",
    "502",
    "503",
    "504",
}
#: Answers that mean "too many requests": the store asks for fewer (``throttle.py`` sends fewer).
THROTTLING_CODES = {
    "SlowDown",
    "ServerBusy",  # Azure
    "rateLimitExceeded",  # GCS
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "TooManyRequestsException",
    "RequestLimitExceeded",
}
# 5xx answers that will not change on a retry
NOT_RETRYABLE_CODES = {"NotImplemented", "501"}
BASE_DELAY_S = 0.05
MAX_DELAY_S = 5.0


class StoreAnswer(Exception):
    """An error answer of a store whose client raises no exception of its own that says one
    (``gcs.py``): its error code and HTTP status."""

    def __init__(self, message: str, code: str, status: int):
        super().__init__(message)
        self.code, self.status = code, status


def store_answer(exc: BaseException | None) -> tuple[str, int | None] | None:
    """``(error code, HTTP status)`` of an error answer from the store: botocore's ``response``, Azure's
    ``status_code`` and ``error_code``, or a ``StoreAnswer``; ``None`` for an error that is not one (a
    timeout, a dropped connection)."""
    if isinstance(exc, StoreAnswer):
        return exc.code, exc.status
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = (response.get("Error") or {}).get("Code")
        return ("" if code is None else str(code)), (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and type(exc).__module__.startswith("azure."):
        code = getattr(exc, "error_code", None) or status
        code = str(getattr(code, "value", code))  # the SDK's StorageErrorCode enum, by its value (Md5Mismatch)
        if status == 400 and "contentmd5 doesn't match" in str(exc).lower():
            code = "Md5Mismatch"  # Azurite's InvalidOperation for what Azure answers as Md5Mismatch
        return code, status
    return None


def is_throttling_answer(code: str | None, status: int | None) -> bool:
    """True for an answer (error code, HTTP status) that asks the client to slow down: SlowDown and
    its kin, or HTTP 429."""
    return code in THROTTLING_CODES or status == 429


def is_throttling(exc: BaseException) -> bool:
    """True for an error that is such an answer (``is_throttling_answer``)."""
    answer = store_answer(exc)
    return answer is not None and is_throttling_answer(*answer)


def is_retryable(exc: BaseException) -> bool:
    """True for throttling, 5xx, timeouts and dropped connections; False for e.g. 403 or 404."""
    answer = store_answer(exc)
    if answer is not None:
        code, status = answer
        if code in NOT_RETRYABLE_CODES or status == 501:
            return False
        return (
            code in RETRYABLE_CODES
            or is_throttling(exc)
            or (isinstance(status, int) and (status >= 500 or status == 408))
        )
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, ConnectionError, OSError)):
        return not isinstance(exc, (FileNotFoundError, PermissionError))
    module = type(exc).__module__ or ""
    # aiohttp client/payload errors, botocore's and Azure's connection and read-timeout errors
    return module.startswith(("aiohttp", "botocore.exceptions", "urllib3", "http.client", "azure.core.exceptions"))


async def with_retries(fn: Callable[[], Awaitable[T]], *, attempts: int, deadline_s: float, what: str) -> T:
    """Await ``fn()``; on a retryable error wait and try again, at most ``attempts`` times in
    ``deadline_s`` seconds. Each attempt gets only the time left before the deadline (a stalled
    endpoint must not hold a request for the client's own, longer read timeout). The last error
    propagates."""
    start = time.monotonic()
    for attempt in range(1, attempts + 1):
        try:
            left = deadline_s - (time.monotonic() - start)
            try:
                return await asyncio.wait_for(fn(), timeout=max(left, 0.001))
            except asyncio.TimeoutError:
                raise TimeoutError(f"{what}: no answer within the {deadline_s:.0f}s retry deadline") from None
        except Exception as exc:
            remaining = deadline_s - (time.monotonic() - start)
            if attempt == attempts or not is_retryable(exc) or remaining <= 0:
                raise
            delay = min(remaining, random.uniform(0, min(MAX_DELAY_S, BASE_DELAY_S * 2**attempt)))
            log.info(
                "ckptio: %s failed (%s: %s); retry %d/%d in %.2fs",
                what,
                type(exc).__name__,
                exc,
                attempt,
                attempts - 1,
                delay,
            )
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")
