"""Adaptive concurrency: a process sends fewer requests at once to an object store that throttles it.

S3 answers a request rate above what a key prefix's partition serves with 503 SlowDown (other
stores: 429, ``Throttling``) until it repartitions, minutes later. Retrying at the same
concurrency keeps the rate where it was, so every request spends its attempts on 503s. Here, each
process keeps one limit per event loop and bucket on its requests in flight, between 1 and
``max_concurrency``: a throttled answer halves it (once per round of requests: answers to
requests sent before the last decrease do not lower it again), and every clean answer raises it by
``1 / limit`` (one request more per round of clean answers), as TCP's congestion control does.
The jitter is the retry's own (``retry.with_retries``: full jitter), so throttled ranks do not come
back in step. The limit holds for a request's attempt, not across its retry waits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import weakref
from typing import AsyncIterator

from ckptio.storage.retry import is_throttling

#: A throttled answer multiplies the limit by this.
DECREASE = 0.5


class AdaptiveLimit:
    """Requests in flight at most ``limit``, which moves between 1 and ``ceiling`` (module doc).
    One event loop uses it; ``throttled`` counts the throttled answers it has seen."""

    def __init__(self, ceiling: int):
        self.ceiling = ceiling
        self.limit = float(ceiling)
        self.in_flight = 0
        self.throttled = 0
        self.lowest = float(ceiling)  # the lowest limit reached (for reports and tests)
        self._started = 0  # requests granted so far; a request's number is its place in that order
        self._decreased_at = 0  # the number of the last request granted before the last decrease
        self._waiting: collections.deque[asyncio.Future] = collections.deque()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the ``limit`` places for the body's request; its outcome adjusts the limit."""
        number = await self._acquire()
        throttled = False
        try:
            yield
        except Exception as exc:
            throttled = is_throttling(exc)
            raise
        finally:
            self._release(number, throttled)

    async def _acquire(self) -> int:
        if self.in_flight >= int(self.limit) or self._waiting:
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                await waiter  # _grant counted this request in flight
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self.in_flight -= 1  # granted, then cancelled before it could run
                    self._grant()
                else:
                    self._waiting.remove(waiter)
                raise
        else:
            self.in_flight += 1
        self._started += 1
        return self._started

    def _release(self, number: int, throttled: bool) -> None:
        self.in_flight -= 1
        if throttled:
            self.throttled += 1
            if number > self._decreased_at:  # sent after the last decrease: the store still throttles
                self.limit = max(1.0, self.limit * DECREASE)
                self.lowest = min(self.lowest, self.limit)
                self._decreased_at = self._started
        else:
            self.limit = min(float(self.ceiling), self.limit + 1.0 / self.limit)
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self.in_flight < int(self.limit):
            waiter = self._waiting.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)


_limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def limit_for(loop: asyncio.AbstractEventLoop, endpoint: str, bucket: str, ceiling: int) -> AdaptiveLimit:
    """The limit of this process's requests to ``bucket`` at ``endpoint`` made on ``loop`` with
    ``max_concurrency`` = ``ceiling``: every such store shares it, so a rank's reader and writer back
    off together."""
    with _lock:
        per_loop = _limits.setdefault(loop, {})
        limit = per_loop.get((endpoint, bucket, ceiling))
        if limit is None:
            limit = per_loop[endpoint, bucket, ceiling] = AdaptiveLimit(ceiling)
        return limit
