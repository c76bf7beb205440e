"""``--async-saves N``: what an asynchronous save costs a training loop, per writer and executor.

Each rank saves the workload N times with ``dcp.async_save``, one save after another, and runs a
CPU training step (a matmul) from the moment ``async_save`` returns until the save is done.
Per save it records the blocking time (the time in ``async_save``), the steps run while the save
was in the background, and the host memory afterwards; a few synchronous saves of the same state
and a stretch of training with no save give the reference points.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import ckptio

from . import counting, workload
from .runner import rank_state, remove_together, report_progress

#: Side of the square fp32 matrices a training step multiplies (a few ms on one core).
STEP_MATRIX = 384
#: Seconds of training without a save that give the steps/s reference.
BASELINE_S = 1.0
#: Synchronous saves timed as the reference for the blocking time.
SYNC_SAVES = 3


@dataclass(frozen=True)
class AsyncSetup:
    """One row of the async benchmark: a writer and the stager that copies the state for it."""

    name: str
    make_writer: Callable[[str], Any]
    make_stager: Callable[[], Any]  # None: the one dcp.async_save picks itself
    make_reader: Callable[[str], Any]
    needs_gpu: bool = False  # torch's cached staging pins its buffers, which needs an accelerator
    by_default: bool = True  # in the default run; the others with --all-stagers


def _ckptio_writer(url: str):
    return ckptio.Writer(url)


def _ckptio_reader(url: str):
    return ckptio.Reader(url)


def _torch_default_stager(pinned_async: bool = False):
    """The stager dcp.async_save makes for a writer that does not stage (pinned_async: the GPU setup
    torch recommends, pinned buffers and staging in the background)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(pinned_async, pinned_async, pinned_async, pinned_async))


SETUPS = [
    AsyncSetup("ckptio plain call", _ckptio_writer, lambda: None, _ckptio_reader),
    AsyncSetup(
        "ckptio + ckptio.Stager", _ckptio_writer, lambda: ckptio.Stager(slots=2), _ckptio_reader, by_default=False
    ),
    AsyncSetup(
        "ckptio + torch default stager", _ckptio_writer, _torch_default_stager, _ckptio_reader, by_default=False
    ),
    AsyncSetup(
        "ckptio + torch pinned async stager",
        _ckptio_writer,
        lambda: _torch_default_stager(pinned_async=True),
        _ckptio_reader,
        needs_gpu=True,
    ),
    AsyncSetup("torch FileSystemWriter", dcp.FileSystemWriter, lambda: None, dcp.FileSystemReader),
    AsyncSetup(
        "torch FileSystemWriter cache_staged",
        lambda url: dcp.FileSystemWriter(url, cache_staged_state_dict=True),
        lambda: None,
        dcp.FileSystemReader,
        needs_gpu=True,
    ),
]
EXECUTORS = {"THREAD": AsyncCheckpointerType.THREAD, "PROCESS": AsyncCheckpointerType.PROCESS}


class TrainingStep:
    """A stand-in for a training step: one matmul, so it competes for cores, not for the GIL."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.a = torch.randn(STEP_MATRIX, STEP_MATRIX, generator=gen)
        self.b = torch.randn(STEP_MATRIX, STEP_MATRIX, generator=gen)

    def __call__(self) -> None:
        torch.mm(self.a, self.b)

    def run_for(self, seconds: float) -> tuple[int, float]:
        start, steps = counting.now(), 0
        while counting.now() - start < seconds:
            self()
            steps += 1
        return steps, counting.now() - start

    def run_until(self, done: Callable[[], bool]) -> tuple[int, float]:
        start, steps = counting.now(), 0
        while not done():
            self()
            steps += 1
        return steps, counting.now() - start


def run_rank(cfg: dict) -> list[dict]:
    """One record per (setup, executor) with this rank's per-save figures."""
    rank, mesh, specs, state = rank_state(cfg)
    step = TrainingStep()
    records = []
    # THREAD first: torch's PROCESS executor keeps its background process until the job ends.
    for executor in EXECUTORS:
        for setup in SETUPS:
            if setup.name in cfg["async_setups"] and (cfg["device"] == "cuda" or not setup.needs_gpu):
                records.append(_measure(setup, executor, state, mesh, specs, step, cfg, rank))
                report_progress(cfg, "async", setup.name, executor)
    return records


def _measure(setup: AsyncSetup, executor: str, state, mesh, specs, step: TrainingStep, cfg: dict, rank: int) -> dict:
    base = f"{cfg['async_base']}/{setup.name.replace(' ', '_').replace('+', '')}-{executor}"
    sync_s = []
    for k in range(SYNC_SAVES):
        url = f"{base}/sync{k}"
        dist.barrier()
        start = counting.now()
        dcp.save(state, storage_writer=setup.make_writer(url))
        sync_s.append(counting.now() - start)
        remove_together(url)
    dist.barrier()
    baseline_steps, baseline_s = step.run_for(BASELINE_S)
    stager = setup.make_stager()
    saves = []
    last_url = None
    try:
        for k in range(cfg["async_saves"]):
            url = f"{base}/async{k}"
            dist.barrier()
            start = counting.now()
            future = dcp.async_save(
                state,
                storage_writer=setup.make_writer(url),
                async_checkpointer_type=EXECUTORS[executor],
                async_stager=stager,
            )
            blocking = counting.now() - start
            future = getattr(future, "upload_completion", future)  # an AsyncSaveResponse (staging in the background)
            steps, during_s = step.run_until(future.done)
            future.result()
            dist.barrier()
            saves.append(
                {
                    "blocking_s": blocking,
                    "background_s": during_s,
                    "steps": steps,
                    "rss_bytes": counting.rss(),
                    "tree_pss_bytes": process_tree_pss(),
                }
            )
            if last_url is not None:
                remove_together(last_url)
            last_url = url
    finally:
        if stager is not None:
            stager.close()
        ckptio.release_staging_buffers()  # the plain call's: the next row starts without them
    loaded = workload.build_state(mesh, specs, cfg["data"], rank, empty=True)
    dcp.load(loaded, storage_reader=setup.make_reader(last_url))
    mismatches = workload.check_state(loaded, specs, cfg["data"], rank)
    remove_together(last_url)
    return {
        "setup": setup.name,
        "executor": executor,
        "rank": rank,
        "payload_bytes": workload.held_tensor_bytes(state),
        "sync_s": sync_s,
        "baseline_steps": baseline_steps,
        "baseline_s": baseline_s,
        "saves": saves,
        "mismatches": mismatches,
    }


def process_tree_pss() -> int:
    """Proportional set size of this process and its descendants (torch's PROCESS executor runs
    saves in a child): shared pages are split between the processes that map them, not counted twice."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry))
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            continue
    return total


def summarize(records: list[dict]) -> list[dict]:
    """One row per (setup, executor): slowest rank's times, mean steps/s, largest memory growth.
    Blocking times are of saves 2..N (the first creates torch's executor and the stager's buffers);
    memory growth is from after save 2 to after save N."""
    grouped: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        grouped[(r["setup"], r["executor"])].append(r)
    rows = []
    for (setup, executor), recs in grouped.items():
        n = len(recs[0]["saves"])
        blocking = [max(r["saves"][k]["blocking_s"] for r in recs) for k in range(1, n)] or [
            max(r["saves"][0]["blocking_s"] for r in recs)
        ]
        sync = [max(r["sync_s"][k] for r in recs) for k in range(len(recs[0]["sync_s"]))]
        background = [max(r["saves"][k]["background_s"] for r in recs) for k in range(n)]
        before = statistics.mean(r["baseline_steps"] / r["baseline_s"] for r in recs)
        during = statistics.mean(
            sum(s["steps"] for s in r["saves"]) / max(sum(s["background_s"] for s in r["saves"]), 1e-9) for r in recs
        )
        payload = max(r["payload_bytes"] for r in recs)
        second = min(1, n - 1)
        rss_growth = max(r["saves"][-1]["rss_bytes"] - r["saves"][second]["rss_bytes"] for r in recs)
        pss_growth = max(r["saves"][-1]["tree_pss_bytes"] - r["saves"][second]["tree_pss_bytes"] for r in recs)
        rows.append(
            {
                "setup": setup,
                "executor": executor,
                "saves": n,
                "sync_s_median": statistics.median(sync),
                "blocking_s_median": statistics.median(blocking),
                "blocking_s_min": min(blocking),
                "blocking_s_max": max(blocking),
                "blocking_over_sync": statistics.median(blocking) / statistics.median(sync),
                "background_s_median": statistics.median(background),
                "steps_per_s_before": before,
                "steps_per_s_during": during,
                "training_speed_during": during / before if before else None,
                "payload_bytes": payload,
                "rss_growth_bytes": rss_growth,
                "tree_pss_growth_bytes": pss_growth,
                "tree_pss_growth_over_payload": pss_growth / payload if payload else None,
                "tree_pss_after_last_bytes": max(r["saves"][-1]["tree_pss_bytes"] for r in recs),
                "bit_exact": all(not r["mismatches"] for r in recs),
            }
        )
    return rows
