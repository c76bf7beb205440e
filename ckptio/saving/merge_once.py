"""A save without a coordinator merged once, not on every load: once every rank's fragment of the save is
there, the saving job's rank 0 merges the set (``format/merge.py``) in a background thread and commits
``ckptio.json`` create-only, as ``ckptio merge`` does. Loads then read that one document; they merge the
fragments themselves only where it is missing (the job died right after its save, or another save's
fragments were mixed in: the merge refuses them, and so does every load).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable

from ckptio.errors import CheckpointError
from ckptio.loading.fragment_set import fragments_in
from ckptio.saving.commit import commit_merged
from ckptio.storage import FsspecStore

log = logging.getLogger(__name__)

#: How long rank 0 waits for the other ranks' fragments before leaving the merge to the loads.
MERGE_WAIT_S = 600.0
#: How long a process that ends waits for its merges still running.
MERGE_AT_EXIT_S = 30.0
_FIRST_POLL_S, _LAST_POLL_S = 0.05, 2.0

_running: dict[threading.Thread, tuple[str, threading.Event]] = {}  # -> the checkpoint's URL, its cancel
_lock = threading.Lock()


def merge_when_complete(url: str, open_store: Callable[[], FsspecStore], save_id: str, ranks: int) -> None:
    """Merge the fragments of save ``save_id`` (by ``ranks`` ranks) at ``url`` into ``ckptio.json`` once
    all are there."""
    cancel = threading.Event()
    deadline = time.monotonic() + MERGE_WAIT_S
    thread = threading.Thread(target=_merge, args=(open_store, save_id, ranks, deadline, cancel), name="ckptio-merge")
    thread.daemon = True
    with _lock:
        _running[thread] = (url, cancel)
    thread.start()


def settle(url: str) -> None:
    """Before another save to ``url`` starts, or its deletion: this process's merge there is called off
    (it would otherwise commit the earlier save's ``ckptio.json`` over the new save's fragments, or into
    a deleted folder) and has ended; a merge called off is left to the loads, as a job that died does."""
    with _lock:
        pending = [(thread, cancel) for thread, (where, cancel) in _running.items() if where == url]
    for thread, cancel in pending:
        cancel.set()
        thread.join()


def wait_for_merges(timeout: float | None = None) -> None:
    """Block until this process's background merges have ended (committed, or left to the loads)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _lock:
        threads = list(_running)
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _merge(
    open_store: Callable[[], FsspecStore], save_id: str, ranks: int, deadline: float, cancel: threading.Event
) -> None:
    try:
        store = open_store()
        poll = _FIRST_POLL_S
        while time.monotonic() < deadline and not cancel.is_set():
            if len(fragments_in(store.list_names() or [])) >= ranks:
                committed = commit_merged(store, save_id, go_on=lambda: not cancel.is_set())
                log.debug("ckptio: %s merged its fragments: %s", store.url, "committed" if committed else "not")
                return
            cancel.wait(poll)
            poll = min(poll * 2, _LAST_POLL_S)
        if not cancel.is_set():
            log.info(
                "ckptio: %s: not every rank's fragment arrived in %.0f s; loads merge them", store.url, MERGE_WAIT_S
            )
    except CheckpointError as exc:  # a mixed or damaged set: every load refuses it by name as well
        log.warning("ckptio: the fragments of this save were not merged: %s", exc)
    except Exception as exc:  # a storage fault: loads merge the fragments themselves
        log.warning("ckptio: the fragments of this save were not merged (loads merge them): %r", exc)
    finally:
        with _lock:
            _running.pop(threading.current_thread(), None)


@atexit.register
def _merge_at_exit() -> None:
    if _running:
        wait_for_merges(MERGE_AT_EXIT_S)
