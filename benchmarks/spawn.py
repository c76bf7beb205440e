"""Run a function on N spawned processes joined by a gloo process group on loopback."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, env: dict) -> None:
    import torch.distributed as dist

    os.environ.update(env)
    result_path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        if world_size > 0:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                timeout=__import__("datetime").timedelta(seconds=float(env.get("CKPTIO_TEST_PG_TIMEOUT", 120))),
            )
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


def spawn(world_size: int, fn: Callable, *args: Any, timeout: float = 240, env: dict | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks and return each rank's result.

    Raises ``RuntimeError`` with the failing ranks' tracebacks if any rank fails or the run
    exceeds ``timeout`` seconds. ``world_size=0`` runs one process without a process group.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = []
    with tempfile.TemporaryDirectory() as out_dir:
        for rank in range(max(world_size, 1)):
            p = ctx.Process(target=_entry, args=(rank, world_size, port, out_dir, fn, args, dict(env or {})))
            p.start()
            procs.append(p)
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        for rank in range(len(procs)):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: no result (exit code {procs[rank].exitcode})")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results.append(value)
        if hung:
            errors.insert(0, f"ranks {hung} still running after {timeout}s")
        if errors:
            raise RuntimeError("\n".join(errors))
        return results


def spawn_expect_failure(world_size: int, fn: Callable, *args: Any, timeout: float = 240,
                         env: dict | None = None) -> str:
    """Like ``spawn`` but the run must fail; returns the combined error text."""
    try:
        spawn(world_size, fn, *args, timeout=timeout, env=env)
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("the distributed run was expected to fail but every rank succeeded")
