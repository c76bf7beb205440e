"""``exchange.all_objects``: every rank's value on every rank, in group rank order, over the default group
and over a group of some of the ranks, small values and large."""

from __future__ import annotations

from ckptio.loading.exchange import all_objects
from tests.helpers.harness import spawn


def _values(rank: int) -> object:
    return {"rank": rank, "blob": bytes([rank]) * (rank * 300_000), "nested": [("x", rank)] * rank}


def _exchange() -> tuple[list, list | None]:
    import torch.distributed as dist

    rank = dist.get_rank()
    everyone = all_objects(_values(rank))
    twice = all_objects(rank * 10)  # a second exchange right after: its messages do not mix with the first's
    odd = dist.new_group([1, 3])
    among_odd = all_objects(_values(rank), odd) if rank in (1, 3) else None
    return everyone + [twice], among_odd


def test_every_rank_gets_every_ranks_value_in_rank_order_over_any_group():
    got = spawn(4, _exchange)
    for rank, (everyone, among_odd) in enumerate(got):
        assert everyone == [_values(r) for r in range(4)] + [[0, 10, 20, 30]]
        assert among_odd == ([_values(1), _values(3)] if rank in (1, 3) else None)
