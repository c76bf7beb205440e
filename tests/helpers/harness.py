"""Run a function on N spawned processes joined by a gloo process group on loopback (the tests' harness)."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp
from ckptio.bench.launch import PRELOAD as BENCH_PRELOAD
from ckptio.bench.launch import join_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, env: dict, backend: str = "gloo"
) -> None:
    import torch.distributed as dist

    # A fork of the preloaded server has the server's environment and directory: take the test's.
    os.chdir(env.pop("_CKPTIO_TEST_CWD", os.getcwd()))
    os.environ.clear()
    os.environ.update(env)
    result_path = os.path.join(out_dir, f"rank{rank}.pkl")
    # A rank's process runs ckptio's exit hook (multiprocessing ends a child through threading's shutdown): work a
    # test leaves behind that makes no progress (a merge waiting for a rank the test killed) holds it this long.
    from ckptio import process_exit

    process_exit.EXIT_STALL_S = float(env.get("CKPTIO_TEST_EXIT_STALL_S", 3.0))
    try:
        if world_size > 0:
            timeout = datetime.timedelta(seconds=float(env.get("CKPTIO_TEST_PG_TIMEOUT", 120)))
            join_group(backend, port, rank, world_size, timeout)
        value = fn(*args)
        with open(result_path, "wb") as f:
            pickle.dump(("ok", value), f)
    except BaseException:
        with open(result_path, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        raise
    finally:
        if world_size > 0 and dist.is_initialized():
            dist.destroy_process_group()


#: Imported once by the forkserver that every rank is forked from: a rank starts in milliseconds
#: instead of importing torch anew (about a second of CPU each, four at once on two cores). The
#: bench's list (torch, torch._dynamo, s3fs, ckptio and its lazy modules: what ranks import on first
#: use, found in their ``sys.modules``), and the tests' per-rank bodies.
PRELOAD = [*BENCH_PRELOAD, "tests.helpers.scenarios"]


def rank_context():
    """Ranks start as clean single-threaded forks of a preloaded server process (no CUDA, no
    threads, no open process group in it), which is as isolated as a fresh spawn."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(
    world_size: int, fn: Callable, *args: Any, timeout: float = 240, env: dict | None = None, backend: str = "gloo"
) -> list[tuple[str, Any]]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return each rank's ``(status, value)``:
    ``("ok", result)``, ``("error", traceback)``, ``("died", exit code)`` or ``("hung", None)``.
    ``world_size=0`` runs one process without a process group."""
    ctx = rank_context() if backend == "gloo" else mp.get_context("spawn")
    port = free_port()
    procs = []
    with tempfile.TemporaryDirectory() as out_dir:
        for rank in range(max(world_size, 1)):
            rank_env = {**os.environ, **(env or {}), "_CKPTIO_TEST_CWD": os.getcwd()}
            p = ctx.Process(target=_entry, args=(rank, world_size, port, out_dir, fn, args, rank_env, backend))
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        outcomes: list[tuple[str, Any]] = []
        for rank, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                outcomes.append(("hung", None))
                continue
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                outcomes.append(("died", p.exitcode))
                continue
            with open(path, "rb") as f:
                outcomes.append(pickle.load(f))
        return outcomes


def spawn(
    world_size: int, fn: Callable, *args: Any, timeout: float = 240, env: dict | None = None, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks and return each rank's result; raise
    ``RuntimeError`` with every failing rank's traceback if any rank fails or hangs."""
    outcomes = run_ranks(world_size, fn, *args, timeout=timeout, env=env, backend=backend)
    errors = [
        f"rank {rank}: {status}\n{value if value is not None else ''}"
        for rank, (status, value) in enumerate(outcomes)
        if status != "ok"
    ]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [value for _, value in outcomes]
