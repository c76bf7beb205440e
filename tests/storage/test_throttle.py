"""Adaptive concurrency on throttling (``ckptio.storage.throttle``): the limit itself, then S3 requests
through a proxy that throttles as S3 does."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from botocore.exceptions import ClientError
from fsspec.asyn import sync

import ckptio
from ckptio.storage import open_store
from ckptio.storage.base import RangeRequest
from ckptio.storage.throttle import PAUSE_FIRST_S, AdaptiveLimit
from tests.conftest import S3_SERVERS
from tests.helpers.faultproxy import Fault, PrefixRateLimit


def _slow_down() -> ClientError:
    return ClientError({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "UploadPart")


async def _requests(limit: AdaptiveLimit, count: int, throttled: bool = False) -> int:
    """``count`` requests at once through ``limit``, each answered (throttled or not) once all that
    may run are running; returns the most that ran at once, each let in only below the limit."""
    running, most = [0], [0]
    go = asyncio.Event()

    async def request() -> None:
        async with limit.slot():
            running[0] += 1
            assert running[0] <= int(limit.limit), "a request ran past the limit"
            most[0] = max(most[0], running[0])
            if running[0] >= int(limit.limit) or running[0] == count:
                go.set()
            await go.wait()
            await asyncio.sleep(0)
            running[0] -= 1
            if throttled:
                raise _slow_down()

    await asyncio.gather(*(request() for _ in range(count)), return_exceptions=True)
    return most[0]


def test_a_round_of_throttled_answers_halves_the_limit_once_then_each_later_round_again():
    async def main() -> None:
        limit = AdaptiveLimit(8)
        assert await _requests(limit, 8, throttled=True) == 8
        assert (limit.limit, limit.throttled) == (4.0, 8)  # eight answers of one round: one halving
        assert await _requests(limit, 4, throttled=True) == 4
        assert limit.limit == 2.0
        for _ in range(3):
            await _requests(limit, 1, throttled=True)
        assert (limit.limit, limit.lowest, limit.throttled) == (1.0, 1.0, 15)  # never below one request

    asyncio.run(main())


def test_a_lowered_limit_bounds_the_requests_in_flight_and_clean_answers_raise_it_to_the_ceiling():
    async def main() -> None:
        limit = AdaptiveLimit(8)
        limit.limit = 2.0
        expected = 2.0
        for _ in range(10):
            expected = min(8.0, expected + 1 / expected)
        # ten at once: two in flight, one more as the clean answers raise the limit (to 4.2 after ten)
        assert await _requests(limit, 10) == int(expected) - 1
        assert limit.limit == pytest.approx(expected, abs=1e-12) and limit.limit < 8
        for _ in range(40):
            await _requests(limit, 1)
        assert limit.limit == 8.0 and limit.in_flight == 0

    asyncio.run(main())


def test_a_throttled_answer_pauses_new_requests_longer_each_throttled_round():
    async def main() -> None:
        limit = AdaptiveLimit(4)
        await _requests(limit, 1, throttled=True)
        started = time.monotonic()
        await _requests(limit, 1, throttled=True)  # nothing in flight: it starts when the pause ends
        first_pause = time.monotonic() - started
        started = time.monotonic()
        await _requests(limit, 1)  # the second round's pause is twice as long, up to x1.5 jitter
        assert first_pause >= PAUSE_FIRST_S * 0.5 and time.monotonic() - started >= PAUSE_FIRST_S
        assert limit.throttled == 2 and limit.limit == 1.0 + 1.0

    asyncio.run(main())


def test_other_failures_move_the_limit_neither_down_nor_up():
    async def main() -> None:
        limit = AdaptiveLimit(8)
        limit.limit = 3.0

        async def failing() -> None:
            async with limit.slot():
                error = {"Error": {"Code": "InternalError"}, "ResponseMetadata": {"HTTPStatusCode": 500}}
                raise ClientError(error, "GetObject")

        await asyncio.gather(*(failing() for _ in range(5)), return_exceptions=True)
        assert (limit.limit, limit.throttled, limit.in_flight) == (3.0, 0, 0)
        await _requests(limit, 1)
        assert limit.limit == 3.0 + 1.0 / 3.0

    asyncio.run(main())


def test_a_cancelled_request_gives_its_place_back_whether_it_waited_or_was_just_let_in():
    async def main() -> None:
        limit = AdaptiveLimit(1)
        holding, let_go = asyncio.Event(), asyncio.Event()

        async def holder() -> None:
            async with limit.slot():
                holding.set()
                await let_go.wait()

        async def waiter() -> None:
            async with limit.slot():
                raise AssertionError("a cancelled request ran")

        first = asyncio.create_task(holder())
        await holding.wait()
        queued = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        queued.cancel()  # cancelled while waiting
        await asyncio.gather(queued, return_exceptions=True)
        queued = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        let_go.set()
        await first  # its release lets the waiter in ...
        queued.cancel()  # ... which is cancelled before it runs
        await asyncio.gather(queued, return_exceptions=True)
        assert limit.in_flight == 0
        assert await _requests(limit, 3) == 1

    asyncio.run(main())


def test_throttled_gets_lower_the_stores_requests_in_flight_and_clean_ones_restore_them(s3_proxy):
    proxy, base, options = s3_proxy
    url = f"{base}/ranges"
    open_store(url, options).put_atomic("blob", bytes(range(256)) * 64)
    store = open_store(url, options)
    limit = sync(store.fs.loop, store.limit)
    proxy.reset()
    # the first GET of each of the first 8 ranges, whatever order the proxy sees them in (under load a
    # retry, or a later range, can overtake one of them)
    first_eight = {f"bytes={k * 1024}-{(k + 1) * 1024 - 1}" for k in range(8)}

    def first_try(r) -> bool:
        fresh = r.operation == "GET" and r.range in first_eight
        first_eight.discard(r.range)
        return fresh

    proxy.faults.append(Fault(first_try, 503, times=8))
    requests = [RangeRequest("blob", k * 1024, (k + 1) * 1024) for k in range(16)]
    assert store.read_ranges(requests) == [(bytes(range(256)) * 4)] * 16
    stats = proxy.reset()
    # the first 8 sent together, all throttled: one halving; each retried once, then 8 more, all clean
    assert (limit.throttled, limit.lowest) == (8, 4.0)
    assert stats.requests["GET"] == 24 and stats.failed["GET"] == 8 and stats.peak_in_flight <= 8
    assert 4.0 < limit.limit < 8.0
    store.read_ranges(requests * 3)
    assert limit.limit == 8.0


@pytest.mark.parametrize("s3", S3_SERVERS, indirect=True)
def test_a_save_and_load_throttled_per_prefix_complete_bit_exact(s3_proxy):
    proxy, base, options = s3_proxy
    url = f"{base}/run/step-1"
    state = {"w": torch.randn(10 << 20 // 4), "b": torch.arange(1000)}  # 10 MiB: parts of 5 MiB
    limit = sync(open_store(url, options).fs.loop, open_store(url, options).limit)
    proxy.faults.append(PrefixRateLimit(rate=5, burst=1))
    config = ckptio.WriterConfig(
        storage_config=ckptio.StorageConfig(part_size=5 << 20), tuning=ckptio.Tuning(max_block_size=64 << 10)
    )
    dcp.save(state, storage_writer=ckptio.Writer(url, config, storage_options=options))
    loaded = {"w": torch.zeros_like(state["w"]), "b": torch.zeros_like(state["b"])}
    reader = ckptio.Reader(url, storage_options=options, storage_config=ckptio.StorageConfig(read_gap_bytes=0))
    dcp.load(loaded, storage_reader=reader)
    stats = proxy.reset()
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
    throttled = sum(stats.failed.values())
    assert throttled > 0 and limit.throttled == throttled  # every 503 seen by the client's limit
    assert limit.lowest < 8
