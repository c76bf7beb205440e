"""The saves of one process run one at a time, in the order their Writers were made.

``dcp.async_save`` with the THREAD executor runs each save on a thread of its own, so a save
started while another is in flight would issue its collectives alongside the other's, in an
order that differs across ranks: the job hangs or pairs up the wrong messages. Each ``Writer``
takes a ticket where it is made (the training loop's thread: the same order on every rank); a
save waits, before its first collective, until the save of the previous ticket has returned.
With the PROCESS executor the save runs in torch's background process, sent there by a thread
of the executor's own, which pickles the Writer: that thread is the one that waits, and the one
waited for. torch decides on the caller's thread whether that process must be started (a
collective on every rank) but starts it on the executor's thread, so a save staged while the
previous one is still starting it would start a second one, at a different moment on each rank
(the ranks then pair up different processes and the save hangs): ``await_previous_start`` holds
such a save until the previous one has begun.
"""

from __future__ import annotations

import logging
import threading

from ckptio.torch_seam import process_executor_running

log = logging.getLogger(__name__)

#: How long a save waits for the previous Writer's save to begin before giving up on it (a
#: Writer made but never used that is still alive; one that was freed is not waited for).
START_WAIT_S = 120.0
#: Name prefix of the threads torch's THREAD executor runs saves on.
ASYNC_THREAD_PREFIX = "AsyncCheckpointExecutor"

_lock = threading.Lock()
_last: "Ticket | None" = None


class Ticket:
    def __init__(self, previous: "Ticket | None"):
        self.previous = previous
        self.thread: threading.Thread | None = None
        self.started = threading.Event()
        self.joinable = False  # the save runs on a thread of torch's async executors
        self.staged = False  # a Stager has staged this save's state
        self.abandoned = False  # its Writer was freed without saving

    def finished(self, wait_s: float = 0.0) -> bool:
        """Whether this save has returned (waiting up to ``wait_s`` for it), without waiting for
        the saves before it: what a stager asks before reusing the buffers this save read."""
        if not self.started.wait(wait_s):
            return False
        if self.abandoned or not self.joinable or self.thread is threading.current_thread():
            return True
        self.thread.join(wait_s)
        return not self.thread.is_alive()

    def wait_until_finished(self) -> None:
        ticket: Ticket | None = self
        while ticket is not None:
            if not ticket.started.wait(START_WAIT_S):
                log.warning("ckptio: the previous Writer made in this process never started saving; not waiting")
                return
            if ticket.abandoned:  # its Writer was freed unused: the save before it is the one to wait for
                ticket = ticket.previous
                continue
            # Only torch's async executor threads are waited for: any other thread ran a synchronous
            # save, which returned before its caller could start another (and may be our caller).
            if ticket.joinable and ticket.thread is not threading.current_thread():
                ticket.thread.join()
            return


def await_previous_start(ticket: Ticket | None) -> None:
    """Where ``dcp.async_save`` stages a save (the caller's thread, before torch's executor takes
    it): if the save before ``ticket`` was staged too but has not begun, and torch's PROCESS
    executor has no background process yet, wait until that save has begun: by then the process it
    started is torch's. A Writer made but never staged is not waited for here."""
    previous = ticket.previous if ticket is not None else None
    if previous is None or not previous.staged or previous.started.is_set() or process_executor_running():
        return
    if not previous.started.wait(START_WAIT_S):
        log.warning("ckptio: the previous asynchronous save never began; staging this one without waiting")


def take() -> Ticket:
    """A place in this process's order of saves (call where the Writer is made)."""
    global _last
    with _lock:
        _last = Ticket(_last)
        return _last


def abandon(ticket: Ticket) -> None:
    """The Writer holding ``ticket`` was freed without saving: waiting for it means waiting for
    the save before it."""
    if not ticket.started.is_set():
        ticket.abandoned = True
        ticket.started.set()


def claim_latest() -> Ticket | None:
    """The ticket of the Writer made last, if no stager has claimed it yet: ``ckptio.Stager`` is
    called by ``dcp.async_save`` right after that Writer was made, for that Writer's save."""
    with _lock:
        return claim(_last)


def claim(ticket: Ticket | None) -> Ticket | None:
    """Mark ``ticket``'s save as staged, if it has not started and no stager has claimed it."""
    if ticket is None or ticket.staged or ticket.started.is_set():
        return None
    ticket.staged = True
    return ticket


def begin(ticket: Ticket | None, sending_to_process: bool = False) -> Ticket:
    """Wait for the save before ``ticket`` to return, then mark ``ticket``'s save as running on
    this thread. A ticket already used (a Writer saving again) is replaced by a new one.
    ``sending_to_process``: this thread hands the save to torch's background process."""
    if ticket is None or ticket.started.is_set():
        ticket = take()
    previous, ticket.previous = ticket.previous, None
    if previous is not None:
        previous.wait_until_finished()
    ticket.thread = threading.current_thread()
    ticket.joinable = sending_to_process or ticket.thread.name.startswith(ASYNC_THREAD_PREFIX)
    ticket.started.set()
    return ticket
