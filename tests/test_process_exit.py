"""ckptio's exit hook runs before Python shuts its executors down (``process_exit`` relies on CPython's
``threading._register_atexit``): background work can still resolve a host name or run a blocking call then."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import atexit, concurrent.futures, threading, time
from ckptio import process_exit
process_exit.EXIT_STALL_S = 3.0
pool = concurrent.futures.ThreadPoolExecutor(1)
done = []
def job():
    time.sleep(0.5)  # still running when the script ends
    try:
        done.append(pool.submit(lambda: 42).result())
    except RuntimeError as exc:  # "cannot schedule new futures after interpreter shutdown"
        done.append(str(exc))
threading.Thread(target=job, daemon=True).start()
process_exit.background_work("a test's job", lambda: 0 if done else 1)
atexit.register(lambda: print("done", done, process_exit.ended()))
"""


def test_the_seam_names_what_it_needs():
    assert callable(threading._register_atexit), "CPython moved threading._register_atexit: see ckptio/process_exit.py"


def test_background_work_still_runs_on_executors_while_the_process_exits():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.strip() == "done [42] True", out
