"""A process's exit: background work (drains, copies to partner nodes, merges) ends before the interpreter
it needs does, and never holds the process longer than its own progress allows.

Python ends a process in this order: ``threading``'s exit hooks (``concurrent.futures`` registers one that
shuts every executor down, after which an event loop cannot resolve a host name or run a blocking call:
every S3 request fails with "cannot schedule new futures after interpreter shutdown"), then the joining of
non-daemon threads, then ``atexit``'s hooks. Work still running in ``atexit`` therefore has no interpreter
to run on. ckptio's one exit hook runs among ``threading``'s, registered after ``concurrent.futures``'s so
that it runs first (they run last registered first), and waits for every kind of background work at once:

- while any of it makes progress (a piece uploaded or copied, a job done), the process waits;
- ``EXIT_STALL_S`` after the last progress it stops waiting, says what is left, and no request is retried
  after that (``ended()``): a drain cut off so is resumed by the next ``ckptio.latest``.

At a ``drain_bandwidth`` the wait is therefore the pending uploads' own time at that bandwidth plus at
most ``EXIT_STALL_S``.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its exit hook first, so ckptio's runs before it
import dataclasses
import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

#: How long an exiting process waits for background work that makes no progress.
EXIT_STALL_S = 30.0
#: How often the exit hook looks at what is pending.
_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class _Work:
    what: str  # in words: "background uploads"
    pending: Callable[[], int]  # jobs queued or running
    settle: Callable[[], None] | None  # called first: what no longer needs to wait (a commit that never came)


_works: list[_Work] = []
_last_progress = [time.monotonic()]
_ended = threading.Event()
_lock = threading.Lock()


def background_work(what: str, pending: Callable[[], int], settle: Callable[[], None] | None = None) -> None:
    """Register a kind of background work the process's exit waits for (``pending()``: how many jobs)."""
    with _lock:
        _works.append(_Work(what, pending, settle))


def progress() -> None:
    """Background work moved on (a piece sent, a job done): an exiting process keeps waiting."""
    _last_progress[0] = time.monotonic()


def ended() -> bool:
    """Whether the process is past its exit's wait: background work must send and retry nothing more."""
    return _ended.is_set()


def finish_background_work(stall_s: float | None = None) -> list[str]:
    """Wait for every registered kind of background work while it makes progress, at most ``stall_s``
    (``EXIT_STALL_S``) past the last; what was left unfinished, in words (empty: all of it finished)."""
    stall_s = EXIT_STALL_S if stall_s is None else stall_s
    with _lock:
        works = list(_works)
    for work in works:
        if work.settle is not None:
            work.settle()
    progress()
    announced = False
    while True:
        left = [(work.what, n) for work in works if (n := work.pending())]
        if not left:
            return []
        if not announced:
            log.warning("ckptio: waiting for %s before exiting", _said(left))
            announced = True
        if time.monotonic() - _last_progress[0] > stall_s:
            return [_said(left)]
        time.sleep(_POLL_S)


def _said(left: list[tuple[str, int]]) -> str:
    return ", ".join(f"{n} job(s) of {what}" for what, n in left)


def _at_exit() -> None:
    try:
        left = finish_background_work()
        if left:
            log.error(
                "ckptio: exiting with %s unfinished (no progress for %.0f s); the fast-tier copies are kept and "
                "ckptio.latest(...) resumes their uploads on the next start",
                left[0],
                EXIT_STALL_S,
            )
    finally:
        _ended.set()


def _register() -> None:
    register = getattr(threading, "_register_atexit", None)  # CPython >= 3.9: before executors shut down
    if register is None:
        atexit.register(_at_exit)
        return
    try:
        register(_at_exit)
    except RuntimeError:  # imported while the interpreter is already shutting down
        atexit.register(_at_exit)


_register()
