"""A save without a coordinator merged once, not on every load: once every rank's fragment of the save is
there, the saving job's rank 0 merges the set (``format/merge.py``) and commits ``ckptio.json``
create-only, as ``ckptio merge`` does. Loads then read that one document; they merge the fragments
themselves only where it is missing (the job died right after its save, or another save's fragments were
mixed in: the merge refuses them, and so does every load).

A background thread waits for the set. It merges a small one itself; a large one in a process of its
own (``merge_process.py``): a merge holds the interpreter lock for its whole length (seconds at thousands
of fragments), and a training step's Python, waiting for the lock at each of its many small calls, ran 7-9x
slower beside it (a step of 200 small torch calls: 70-72 ms alone, 488-669 ms during a merge of 8,192 FSDP
fragments in a thread, 70.5-71.5 ms while a process merged them; 5 runs each, 2 cores).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import subprocess
import sys
import threading
import time
from typing import Any

from ckptio import process_exit
from ckptio.config import StorageConfig
from ckptio.errors import CheckpointError, MixedFragmentsError
from ckptio.loading.fragment_set import fragments_in
from ckptio.saving.commit import commit_merged
from ckptio.storage import FsspecStore, open_store

log = logging.getLogger(__name__)

#: How long rank 0 waits for the other ranks' fragments before leaving the merge to the loads.
MERGE_WAIT_S = 600.0
_FIRST_POLL_S, _LAST_POLL_S = 0.05, 2.0
#: Sets of more fragments are merged in a process of their own: a merge holds the interpreter lock ~0.6 ms
#: a fragment (64: ~40 ms, the length of a garbage collection), a process costs ~2.5 s of another core and
#: ~300 MB to start (it imports torch).
IN_PROCESS_FRAGMENTS = 64
#: The merge process's exit statuses besides 0 (committed): ``ckptio.json`` was there already or the set
#: is not the save's; the set could not be merged (damaged, a storage fault: loads merge it or refuse
#: it); it cannot read its orders or open the location (this process then merges in a thread); the set
#: mixes saves (an overwrite whose ranks have not all replaced their fragments yet: asked again later).
NOT_COMMITTED, MERGE_FAILED, CANNOT_OPEN, MIXED = 3, 4, 5, 6

_running: dict[threading.Thread, tuple[str, threading.Event]] = {}  # -> the checkpoint's URL, its cancel
_lock = threading.Lock()


def merge_when_complete(
    url: str, storage_options: dict[str, Any], storage_config: StorageConfig, save_id: str, ranks: int
) -> None:
    """Merge the fragments of save ``save_id`` (by ``ranks`` ranks) at ``url`` into ``ckptio.json`` once
    all are there."""
    cancel = threading.Event()
    deadline = time.monotonic() + MERGE_WAIT_S
    where = (url, storage_options, storage_config)
    thread = threading.Thread(target=_merge, args=(where, save_id, ranks, deadline, cancel), name="ckptio-merge")
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


def _merge(where: tuple, save_id: str, ranks: int, deadline: float, cancel: threading.Event) -> None:
    try:
        store = open_store(*where)
        poll = _FIRST_POLL_S
        while time.monotonic() < deadline and not cancel.is_set() and not process_exit.ended():
            found = fragments_in(store.list_names() or [])
            if len(found) >= ranks:
                if any(name.ranks != ranks for name in found.values()):
                    committed = False  # fragments of another rank count: never this save's set, nothing to try
                else:
                    committed = _merge_set(store, where, save_id, ranks, deadline, cancel)
                if committed is not None:
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


def _merge_set(
    store: FsspecStore, where: tuple, save_id: str, ranks: int, deadline: float, cancel: threading.Event
) -> bool | None:
    """Merge the complete-by-name set at ``store``: whether it committed, or ``None`` while it still mixes
    an earlier save's fragments with this one's (an overwrite: each rank replaces its own in turn)."""
    large = ranks > IN_PROCESS_FRAGMENTS and _shared(store) and bool(sys.executable)
    payload = _payload(where, save_id) if large else None
    committed = None if payload is None else _merge_in_process(payload, store.url, deadline, cancel)
    if committed is MIXED:
        return None
    if committed is None:  # a small set, or no merge process could run
        try:
            committed = commit_merged(store, save_id, go_on=lambda: not cancel.is_set()) is not None
        except MixedFragmentsError:
            return None
    return committed


def _shared(store: FsspecStore) -> bool:
    """Whether another process sees what this one sees at ``store`` (not fsspec's ``memory://``)."""
    protocols = store.fs.protocol if isinstance(store.fs.protocol, tuple) else (store.fs.protocol,)
    return "memory" not in protocols


def _payload(where: tuple, save_id: str) -> bytes | None:
    """What the merge process is told, or ``None`` where the storage options do not pickle (a live
    client object): this thread merges then."""
    url, storage_options, storage_config = where
    try:
        return pickle.dumps((url, storage_options, storage_config, save_id))  # read by merge_process.main
    except (pickle.PicklingError, TypeError, AttributeError):
        return None


def _merge_in_process(payload: bytes, url: str, deadline: float, cancel: threading.Event) -> bool | int | None:
    """The merge in a process of its own, which this thread waits for (and ends when called off): whether
    it committed, ``MIXED`` (the set mixes saves), or ``None`` when no process could be started or run."""
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "ckptio.saving.merge_process"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL
        )
    except OSError as exc:
        log.warning("ckptio: cannot start a process to merge the fragments at %s, merging here: %r", url, exc)
        return None
    log.debug("ckptio: merging the fragments at %s in process %d", url, child.pid)
    assert child.stdin is not None
    with contextlib.suppress(BrokenPipeError), child.stdin:  # it ended before reading: its status says why
        child.stdin.write(payload)
    while child.poll() is None:
        if cancel.wait(_FIRST_POLL_S) or time.monotonic() > deadline:
            child.terminate()
            child.wait()
            return False
    if child.returncode == MIXED:
        return MIXED
    if child.returncode not in (0, NOT_COMMITTED, MERGE_FAILED):  # no merge ran (an interpreter without ckptio?)
        log.warning("ckptio: the merge process for %s exited with status %d; merging here", url, child.returncode)
        return None
    return child.returncode == 0


process_exit.background_work("merges of fragments", lambda: len(_running))
