"""Start the benchmark's ranks: W spawned processes joined by a process group on loopback."""

from __future__ import annotations

import datetime
import os
import socket
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    log_path: str | None,
    caller: tuple[dict, str],
    results: Any,
    fn: Callable,
    args: tuple,
) -> None:
    environment, directory = caller  # a fork of the server has the server's: take the caller's
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(directory)
    if log_path:
        redirect_output(log_path, f"rank {rank}")
    if "OMP_NUM_THREADS" not in environment:
        # As torchrun does (OMP_NUM_THREADS=1 for several processes per node): the ranks' thread
        # pools share the cores instead of each spinning on all of them, which every writer's CPU
        # figures would count.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    join_group(backend, port, rank, world_size, datetime.timedelta(minutes=30))
    try:
        results.put((rank, fn(*args)))
    finally:
        dist.destroy_process_group()


def join_group(backend: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """Join the process group that meets on 127.0.0.1:``port`` (with NCCL, on a GPU of this rank's own)."""
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timeout
    )


def redirect_output(log_path: str, who: str) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so torch's C++ warnings and
    the processes it starts follow) to the end of ``log_path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"==== {who} (pid {os.getpid()}) ====\n".encode())
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


#: Imported once by the server the ranks fork from, so each rank starts in milliseconds instead of
#: importing torch anew (seconds of CPU per section on a 2-core machine); with what ranks import on
#: first use: torch._dynamo (reached by FSDP2 and the collectives), s3fs, ckptio's lazy modules.
PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch._dynamo",
    "s3fs",
    "ckptio",
    "ckptio.format.document",
    "ckptio.storage.s3",
    "ckptio.bench.runner",
]


def launch(world_size: int, fn: Callable, *args: Any, backend: str = "gloo", log_path: str | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return each rank's result in rank order.
    A rank that fails raises here with its traceback (torch.multiprocessing reports it).
    ``log_path``: where the ranks' own output goes (warnings, logs); ``None``: this terminal."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Ranks fork from a clean single-threaded server process that never touched CUDA (started at
    # the first launch); each rank takes this process's environment and directory as they are now.
    method = "forkserver" if backend == "gloo" else "spawn"
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(PRELOAD)
    results = context.SimpleQueue()
    ranks = mp.start_processes(
        _rank_main,
        args=(world_size, port, backend, log_path, (dict(os.environ), os.getcwd()), results, fn, args),
        nprocs=world_size,
        join=False,
        start_method=method,
    )
    by_rank: dict[int, Any] = {}
    finished = False
    while not finished:  # drain while waiting: a rank blocks on a full pipe until its result is read
        finished = ranks.join(timeout=0.5)
        while not results.empty():
            rank, value = results.get()
            by_rank[rank] = value
    return [by_rank[r] for r in range(world_size)]
