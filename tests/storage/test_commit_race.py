"""Two jobs saving to one fresh URL at once: on every object store exactly one commits (the store's own
create-only precondition), the other is refused, and the URL loads the committed job's values."""

from __future__ import annotations

import logging
import multiprocessing

import pytest
import torch

import ckptio
from ckptio.format.names import METADATA_NAME
from tests.conftest import STORES_SLOW_BEYOND_MOTO, store_objects
from tests.helpers.faultproxy import Fault

ROUNDS = 5


def _save_each_round(urls: list[str], options: dict, value: int, barrier, results) -> None:
    state = {"w": torch.full((50_000,), float(value)), "who": value}
    for round_, url in enumerate(urls):
        barrier.wait()  # both jobs start each round's save together
        try:
            ckptio.save(state, url, storage_options=options)
            results.put((round_, value, "committed"))
        except ckptio.CheckpointExistsError:
            results.put((round_, value, "refused"))
        except Exception as exc:  # noqa: BLE001 - reported, and fails the test below
            results.put((round_, value, f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("store", STORES_SLOW_BEYOND_MOTO, indirect=True)
def test_of_two_jobs_committing_to_one_url_at_once_exactly_one_succeeds(store):
    base, options = store
    context = multiprocessing.get_context("spawn")
    urls = [f"{base}/race-{round_}" for round_ in range(ROUNDS)]
    barrier, results = context.Barrier(2), context.Queue()
    jobs = [context.Process(target=_save_each_round, args=(urls, options, who, barrier, results)) for who in (1, 2)]
    for job in jobs:
        job.start()
    rounds: dict[int, dict[int, str]] = {}
    for _ in range(2 * ROUNDS):
        round_, who, outcome = results.get(timeout=120)
        rounds.setdefault(round_, {})[who] = outcome
    for job in jobs:
        job.join(30)
    for url, outcomes in zip(urls, (rounds[r] for r in range(ROUNDS)), strict=True):
        assert sorted(outcomes.values()) == ["committed", "refused"], outcomes
        (winner,) = [who for who, outcome in outcomes.items() if outcome == "committed"]
        loaded = {"w": torch.zeros(50_000), "who": 0}
        ckptio.load(loaded, url, storage_options=options)
        assert loaded["who"] == winner and torch.equal(loaded["w"], torch.full((50_000,), float(winner)))
        assert METADATA_NAME in store_objects(url, options)


@pytest.mark.parametrize("store", ["gcs", "azure"], indirect=True)
def test_a_store_that_ignores_the_create_only_precondition_is_refused_before_anything_is_written(store_proxy):
    proxy, base, options = store_proxy
    proxy.faults.append(Fault(lambda r: True, "ignore_precondition"))
    with pytest.raises(ckptio.StorageError, match="ignores the precondition.*Nothing was saved"):
        ckptio.save({"w": torch.ones(3)}, f"{base}/unsafe", storage_options=options)
    assert store_objects(base, options) == {}
    proxy.faults.clear()
    ckptio.save({"w": torch.ones(3)}, f"{base}/safe", storage_options=options)
    assert METADATA_NAME in store_objects(f"{base}/safe", options)


@pytest.mark.parametrize("store", ["gcs", "azure"], indirect=True)
def test_a_store_that_does_not_implement_the_precondition_commits_by_check_then_write_with_one_warning(
    store_proxy, caplog
):
    """As S3's 501 path (``test_s3_failures.py``): a store answering the create-only write 501 Not Implemented."""
    proxy, base, options = store_proxy
    not_implemented = Fault(lambda r: r.conditional, 501)
    proxy.faults.append(not_implemented)
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        for step in (1, 2):
            ckptio.save({"w": torch.full((3,), float(step))}, f"{base}/step-{step}", storage_options=options)
    warnings = [r for r in caplog.records if "does not implement create-only writes" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert not_implemented.hits >= 3  # the probe's two creates and each commit
    with pytest.raises(ckptio.CheckpointExistsError):  # the check still refuses a committed checkpoint
        ckptio.save({"w": torch.ones(3)}, f"{base}/step-1", storage_options=options)
    out = {"w": torch.zeros(3)}
    ckptio.load(out, f"{base}/step-2", storage_options=options)
    assert torch.equal(out["w"], torch.full((3,), 2.0))
