"""Failing on every rank together: a rank that raises while its peers go on into a collective
leaves them waiting until the process group's timeout. Every rank of a group calls
``fail_together`` at the same point with what went wrong on it, if anything; if any rank failed,
every rank raises: the failing rank its own error, the others the lowest failing rank's, with its
class (a ckptio error's) and message, naming that rank and every rank that failed."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ckptio import errors
from ckptio.errors import CheckpointError
from ckptio.loading.exchange import all_objects


def fail_together(failure: BaseException | None, group: Any = None, what: str = "") -> None:
    """Raise on every rank of ``group`` (``None``: the default group) if ``failure`` is set on any.
    ``what`` says what the failing rank was doing, for the other ranks' message ("failed reading
    stored bytes shared with other ranks")."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        # one exchange whether or not any rank failed (~3 ms over gloo; the all_reduce it replaced took 5)
        reports = all_objects(None if failure is None else (type(failure).__name__, str(failure)), group)
        failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
        if failure is None and failed:
            rank, (kind, message) = failed[0]
            cls = getattr(errors, kind, None)
            known = isinstance(cls, type) and issubclass(cls, CheckpointError)
            others = f" (ranks that failed: {[r for r, _ in failed]})" if len(failed) > 1 else ""
            cause = message if known else f"{kind}: {message}"
            raise (cls if known else CheckpointError)(f"rank {rank}{' ' + what if what else ''}: {cause}{others}")
    if failure is None:
        return
    if isinstance(failure, CheckpointError):
        raise failure
    rank = dist.get_rank() if dist.is_initialized() else 0
    raise CheckpointError(f"rank {rank}{' ' + what if what else ''}: {type(failure).__name__}: {failure}") from failure
