"""Properties whose every drawn case saves on spawned ranks and loads on others: the drawing and the
check, shared by the property tests of ``tests/load``. Kept out of ``harness`` (which every rank
imports to run its body): hypothesis would be imported again in each rank."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.harness import spawn

#: Cases drawn per property test whose every case runs on spawned ranks (seconds each): CI draws a
#: few each run, new ones every time; the slow marker more.
RANK_PROPERTY_EXAMPLES = int(os.environ.get("CKPTIO_RANK_PROPERTY_EXAMPLES", 8))


def save_then_compare(bodies: Any, case: dict, url: str) -> None:
    """``bodies.save(case, url)`` on ``case["save_world"]`` ranks, then ``bodies.load_and_compare(case,
    url)`` on ``case["load_world"]``; fails naming, by rank, the keys each loaded wrong."""
    spawn(case["save_world"], bodies.save, case, url)
    wrong = spawn(case["load_world"], bodies.load_and_compare, case, url)
    assert wrong == [[]] * case["load_world"], f"keys loaded wrong, by rank: {wrong}"


def save_then_compare_drawn(cases: st.SearchStrategy, bodies: Any, tmp_path_factory: Any, examples: int) -> None:
    """``save_then_compare`` for ``examples`` cases drawn from ``cases``, each in a directory of its own."""
    counter = iter(range(10**6))

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case: dict) -> None:
        save_then_compare(bodies, case, str(tmp_path_factory.mktemp(f"case{next(counter)}") / "ckpt"))

    run()
