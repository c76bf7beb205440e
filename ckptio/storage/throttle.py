"""Adaptive concurrency: a process sends fewer requests at once to an object store that throttles it.

S3 answers a request rate above what a key prefix's partition serves with 503 SlowDown (other
stores: 429, ``Throttling``) until it repartitions, minutes later. Retrying at the same
concurrency keeps the rate where it was, so every request spends its attempts on 503s. Here, each
process keeps one limit per event loop and bucket on its requests in flight, between 1 and
``max_concurrency``: a throttled answer halves it (once per round of requests: answers to
requests sent before the last decrease do not lower it again), and every successful answer raises it by
``1 / limit`` (one request more per round of clean answers), as TCP's congestion control does.
Fewer requests in flight lower the rate only as much as each takes time: on a fast link a single
request a rank still sends hundreds a second. So a throttled answer also pauses new requests for a
jittered while that doubles with each throttled round in a row (``PAUSE_FIRST_S`` up to
``PAUSE_MAX_S``) and is forgotten at the first clean answer; the jitter keeps throttled ranks out of
step. Other failures (a 500, a timeout, a cancelled request) move neither. The limit holds for a
request's attempt, not across its retry waits (``retry.with_retries``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import threading
import time
import weakref
from typing import AsyncIterator

from ckptio.storage.retry import is_throttling

#: A throttled answer multiplies the limit by this.
DECREASE = 0.5
#: A throttled answer pauses new requests for about this long (x0.5-1.5), doubled per throttled round
#: in a row up to the maximum.
PAUSE_FIRST_S, PAUSE_MAX_S = 0.05, 2.0


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
        self._pause_s = 0.0  # the next throttled answer's pause (0: the last answer was clean)
        self._paused_until = 0.0  # time.monotonic() before which no request starts
        self._wake: asyncio.TimerHandle | None = None

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the ``limit`` places for the body's request; its outcome adjusts the limit."""
        number = await self._acquire()
        throttled: bool | None = None  # None: neither answer (another failure, a cancellation)
        try:
            yield
            throttled = False
        except Exception as exc:
            throttled = True if is_throttling(exc) else None
            raise
        finally:
            self._release(number, throttled)

    async def _acquire(self) -> int:
        if self.in_flight >= int(self.limit) or self._waiting or time.monotonic() < self._paused_until:
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            self._grant()  # in a pause with nothing in flight, the pause's end must wake it
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

    def _release(self, number: int, throttled: bool | None) -> None:
        self.in_flight -= 1
        if throttled:
            self.throttled += 1
            if number > self._decreased_at:  # sent after the last decrease: the store still throttles
                self.limit = max(1.0, self.limit * DECREASE)
                self.lowest = min(self.lowest, self.limit)
                self._decreased_at = self._started
                self._pause_s = min(PAUSE_MAX_S, self._pause_s * 2 or PAUSE_FIRST_S)
            pause_end = time.monotonic() + self._pause_s * random.uniform(0.5, 1.5)
            self._paused_until = max(self._paused_until, pause_end)
        elif throttled is False:
            self.limit = min(float(self.ceiling), self.limit + 1.0 / self.limit)
            self._pause_s = 0.0
        self._grant()

    def _grant(self) -> None:
        paused_for = self._paused_until - time.monotonic()
        if paused_for > 0:
            if self._waiting and self._wake is None:
                self._wake = asyncio.get_running_loop().call_later(paused_for, self._end_pause)
            return
        while self._waiting and self.in_flight < int(self.limit):
            waiter = self._waiting.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)

    def _end_pause(self) -> None:
        self._wake = None
        self._grant()


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
