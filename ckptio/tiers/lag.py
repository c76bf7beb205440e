"""A drain slower than the saves: said once per run with its rates, and bounded.

Each tiered save of a process queues its uploads behind the earlier ones (``drain.py``). When a save
begins while ``LAG_WARNING_SAVES`` or more earlier saves still wait to upload, the process says so once per
run folder: how many saves and bytes wait, how fast the drain uploads and how often saves come, and what
would help. A save that finds ``Tuning.drain_max_queued_saves`` waiting first waits for the oldest to finish
(its fast-tier copy, and every queued base of an incremental chain, stay until their uploads end): nothing
is dropped, and the queue and the fast tier's copies stay bounded.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from ckptio.config import WriterConfig
from ckptio.tiers.jobs import DrainQueue
from ckptio.tiers.paths import split_step

log = logging.getLogger(__name__)

#: Saves waiting to upload when a save begins, from which the lag is worth a word.
LAG_WARNING_SAVES = 3
MiB = 1 << 20

_lock = threading.Lock()
_began: collections.deque[float] = collections.deque(maxlen=32)  # when the recent saves began (monotonic)
_uploads: collections.deque[tuple[int, float]] = collections.deque(maxlen=32)  # (bytes, seconds) of recent uploads
_warned: set[str] = set()  # run folders


def uploaded(nbytes: int, seconds: float) -> None:
    """An upload of ``nbytes`` finished in ``seconds`` (``drain.Upload``)."""
    with _lock:
        _uploads.append((nbytes, seconds))


def save_begins(queue: DrainQueue, url: str, config: WriterConfig, says: bool) -> None:
    """A tiered save to ``url`` begins: note it, say once per run if the drain lags (``says``: this rank
    speaks for the job), and wait for the oldest queued save while ``drain_max_queued_saves`` wait."""
    with _lock:
        _began.append(time.monotonic())
    saves, nbytes = queue.backlog()
    run, _ = split_step(url)
    if says and len(saves) >= LAG_WARNING_SAVES and run not in _warned:
        _warned.add(run)
        log.warning("ckptio: %s", _lag_message(len(saves), nbytes, config))
    bound = config.tuning.drain_max_queued_saves
    while len(saves) >= bound:
        oldest = saves[0]
        log.info(
            "ckptio: %d saves wait to upload (drain_max_queued_saves=%d); waiting for %s", len(saves), bound, oldest
        )
        queue.wait_for_save(oldest, config.tuning.drain_timeout_s)
        saves, _ = queue.backlog()
        if saves and saves[0] == oldest:  # it did not end in its own time: its jobs fail on their own
            break


def _lag_message(saves: int, nbytes: int, config: WriterConfig) -> str:
    with _lock:
        began, uploads = list(_began), list(_uploads)
    every = (began[-1] - began[0]) / (len(began) - 1) if len(began) > 1 else float("nan")
    seconds = sum(s for _, s in uploads)
    rate = sum(n for n, _ in uploads) / seconds / MiB if seconds > 0 else float("nan")
    limit = f"drain_bandwidth={config.drain_bandwidth} B/s" if config.drain_bandwidth else "the durable tier's speed"
    return (
        f"the uploads to the durable tier lag behind the saves: {saves} saves ({nbytes / MiB:.1f} MiB) wait to "
        f"upload; the drain uploads {rate:.1f} MiB/s (limited by {limit}) and a save comes every {every:.1f} s. "
        "Raise drain_bandwidth, save less often, or save incrementally (incremental_from='previous': each save "
        f"uploads what changed). Saves wait for the drain beyond drain_max_queued_saves="
        f"{config.tuning.drain_max_queued_saves}; nothing is dropped"
    )
