"""A queue of background jobs run in order by one thread per queue, below the training's priority: the
drain's (``drain.py``) and the copies to partner nodes (``replication.py``).

A job has ``run(deadline)``. One failing with a storage error is retried with backoff until its deadline
(or until the process's exit stops waiting for it: ``process_exit``);
one that still fails becomes the queue's failure, which ``wait()`` and ``raise_failure()`` raise once, and
the rest of that save's jobs are skipped (those with ``runs_after_failure`` still run).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections import deque
from typing import Any

from ckptio import process_exit
from ckptio.errors import CheckpointExistsError, DrainError, StorageError
from ckptio.tiers.background import lower_this_thread

log = logging.getLogger(__name__)

#: Waits between retries of a failed job: doubling, with jitter.
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 30.0


@dataclasses.dataclass
class _Queued:
    save: str  # the durable URL of the save the job belongs to
    job: Any
    deadline: float


class DrainQueue:
    """Background jobs of this process (its uploads, or its copies to partner nodes), run in order by one
    thread."""

    def __init__(self, name: str = "ckptio-drain", what: str = "background uploads") -> None:
        self.name, self.what = name, what  # its thread's name; what its jobs are, in words
        self._jobs: deque[_Queued] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._current: str | None = None  # the save of the job running
        self._failure: DrainError | None = None
        self._failed_saves: set[str] = set()
        self._thread: threading.Thread | None = None

    def submit(self, save: str, job: Any, timeout_s: float) -> None:
        with self._cond:
            self._jobs.append(_Queued(save, job, time.monotonic() + timeout_s))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued job has finished; raise the first failure since the last raise."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise DrainError(f"{self.what} still running after {timeout} s ({len(self._jobs)} queued)")
                self._cond.wait(left)
        self.raise_failure()

    def raise_failure(self) -> None:
        with self._cond:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def state(self, save: str) -> str:
        """``"failed"``, ``"queued"`` (a job of ``save`` is queued or running) or ``"done"``."""
        with self._cond:
            if save in self._failed_saves:
                return "failed"
            running = self._busy and self._current == save
            return "queued" if running or any(q.save == save for q in self._jobs) else "done"

    def backlog(self) -> tuple[list[str], int]:
        """The saves with jobs queued or running, oldest first, and the bytes their queued uploads hold."""
        with self._cond:
            jobs = [q.job for q in self._jobs]
            saves = ([self._current] if self._busy and self._current else []) + [q.save for q in self._jobs]
        return list(dict.fromkeys(saves)), sum(getattr(job, "nbytes", 0) for job in jobs)

    def wait_for_save(self, save: str, timeout: float) -> bool:
        """Block until no job of ``save`` is queued or running, at most ``timeout`` seconds; whether it is so."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._busy and self._current == save or any(q.save == save for q in self._jobs):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._jobs) + self._busy

    def _run(self) -> None:
        lower_this_thread()
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                queued = self._jobs.popleft()
                self._busy, self._current = True, queued.save
            try:
                if queued.save not in self._failed_saves or getattr(queued.job, "runs_after_failure", False):
                    _run_with_retries(queued)
            except Exception as exc:  # noqa: BLE001 - kept for wait_for_uploads / the next save
                failure = _as_drain_error(exc, queued.save)
                log.error("ckptio: %s", failure)
                _tell(queued.job, failure)
                with self._cond:
                    self._failed_saves.add(queued.save)
                    self._failure = self._failure or failure
            finally:
                process_exit.progress()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def _tell(job: Any, failure: DrainError) -> None:
    """A job that others wait for says it gave up (``gave_up``), so they end now, not at their deadline."""
    gave_up = getattr(job, "gave_up", None)
    if gave_up is None:
        return
    try:
        gave_up(failure)
    except Exception as exc:  # noqa: BLE001 - they end at their deadline then, as before
        log.warning("ckptio: cannot record that %s gave up: %r", type(job).__name__, exc)


def _as_drain_error(exc: Exception, save: str) -> DrainError:
    if isinstance(exc, DrainError):
        return exc
    failure = DrainError(
        f"background upload to {save.partition('#')[0]} failed: {type(exc).__name__}: {exc}. The fast-tier copy "
        "is kept; the durable tier holds its previous checkpoint"
    )
    failure.__cause__ = exc
    return failure


def _run_with_retries(queued: _Queued) -> None:
    wait = RETRY_FIRST_S
    while True:
        if process_exit.ended():  # the interpreter is going: nothing more is sent
            raise DrainError(f"the process exited before the background job for {queued.save} ran")
        try:
            queued.job.run(queued.deadline)
            return
        except (DrainError, CheckpointExistsError):
            raise
        except (StorageError, OSError) as exc:
            if time.monotonic() + wait > queued.deadline or process_exit.ended():
                raise
            log.warning("ckptio: background upload to %s failed, retrying in %.1f s: %s", queued.save, wait, exc)
            time.sleep(wait * random.uniform(0.75, 1.25))
            wait = min(wait * 2, RETRY_MAX_S)
