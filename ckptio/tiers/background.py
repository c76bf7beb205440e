"""The drain's threads run below the training's CPU priority.

A drain competes for cores with the training loop (and with the ranks of a save still writing).
Its work runs in two threads: the drain's own (reading the node's file, checking CRC32Cs) and, for
an asynchronous store (s3fs), an event loop of its own in place of fsspec's shared one (signing,
sending). Both are reniced by ``DRAIN_NICE`` (Linux renices one thread at a time), so when the
cores are busy they take what the training leaves, and when they are idle the drain runs at full
speed. Foreground reads and writes keep fsspec's loop at normal priority.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

import fsspec
from fsspec.core import split_protocol

log = logging.getLogger(__name__)

#: Added to the drain threads' nice value (19 at most): CFS then gives such a thread about a tenth
#: of the CPU a normal one gets while both want it.
DRAIN_NICE = 10

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def lower_this_thread() -> None:
    """Set the calling thread's nice value to the process's (its main thread's) plus ``DRAIN_NICE``;
    a no-op where threads cannot be reniced. Threads it starts inherit that value."""
    try:
        nice = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + DRAIN_NICE)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError) as exc:
        log.debug("ckptio: the drain runs at normal priority: %s", exc)


def drain_storage_options(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` for the drain's store of ``url``: an asynchronous filesystem runs on the
    drain's own event loop (fsspec caches that instance apart from the foreground's)."""
    protocol = split_protocol(url)[0] or "file"
    try:
        asynchronous = getattr(fsspec.get_filesystem_class(protocol), "async_impl", False)
    except (ImportError, ValueError):
        asynchronous = False
    return {**storage_options, "loop": _drain_loop()} if asynchronous else storage_options


def _drain_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            running = threading.Event()

            def run() -> None:
                lower_this_thread()
                asyncio.set_event_loop(loop)
                loop.call_soon(running.set)
                loop.run_forever()

            threading.Thread(target=run, name="ckptio-drain-io", daemon=True).start()
            running.wait()
            _loop = loop
    return _loop
