"""Per-rank bodies for the outside-test findings (tests/test_findings.py)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import ckptio


def _outcome(fn) -> str:
    """``"ok"``, or the ckptio error a save/load raised, as ``ClassName: message``."""
    try:
        fn()
        return "ok"
    except CheckpointException as exc:
        error = ckptio.unwrap(exc)
        return f"{type(error).__name__}: {error}"
    except ckptio.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"


def save_twice_with_plan_caching(url: str) -> tuple[list[str], list[str], list[str]]:
    """Two overwriting saves of one structure with torch's plan cache on: the data file names of
    each, and what the second save loaded back wrong."""
    rank = dist.get_rank()
    names = []
    for step in (1, 2):
        state = {"w": torch.full((1024, 64), float(step)), f"own{rank}": torch.full((8,), float(step + rank))}
        planner = DefaultSavePlanner(enable_plan_caching=True)
        dcp.save(state, storage_writer=ckptio.Writer(url, overwrite=True), planner=planner)
        dist.barrier()
        names.append(sorted(n for n in os.listdir(url) if n.endswith(".ckio")))
    out = {"w": torch.zeros(1024, 64), f"own{rank}": torch.zeros(8)}
    dcp.load(out, storage_reader=ckptio.Reader(url))
    wrong = [] if torch.equal(out["w"], torch.full((1024, 64), 2.0)) else ["w"]
    wrong += [] if torch.equal(out[f"own{rank}"], torch.full((8,), 2.0 + rank)) else [f"own{rank}"]
    return names[0], names[1], wrong


def save_per_rank_tensor(url: str, which: str) -> str:
    rank = dist.get_rank()
    if which == "rng":
        torch.manual_seed(1000 + rank)  # a per-rank seed, as data-parallel jobs do
        state = {"rng": torch.get_rng_state()}
    elif which == "counter":
        state = {"samples_seen": torch.tensor(17 * (rank + 1))}
    else:  # a large tensor that differs in one element every 1000
        value = torch.zeros(1 << 20)
        value[::1000] = rank
        state = {"noise": value}
    state["shared"] = torch.arange(10.0)
    return _outcome(lambda: dcp.save(state, storage_writer=ckptio.Writer(url)))


def save_equal_objects_with_different_pickles(url: str) -> tuple[str, object, object]:
    rank = dist.get_rank()
    keys = ["lr", "warmup", "betas", "name"] if rank == 0 else ["name", "betas", "warmup", "lr"]
    values = {"lr": 0.1, "warmup": 100, "betas": (0.9, 0.95), "name": "run"}
    config = {k: values[k] for k in keys}  # the same dict, built in another order on each rank
    tags = {f"tag-{i}" for i in range(32)}  # string sets iterate in per-process hash order
    outcome = _outcome(lambda: dcp.save({"config": config, "tags": tags}, storage_writer=ckptio.Writer(url)))
    loaded = {"config": dict.fromkeys(values), "tags": None}
    if outcome == "ok":
        dcp.load(loaded, storage_reader=ckptio.Reader(url), planner=ckptio.SafeLoadPlanner())
    return outcome, loaded["config"], loaded["tags"]


def save_to_a_per_rank_path(base: str) -> str:
    url = os.path.join(base, f"step-100-{dist.get_rank()}")  # e.g. built from a per-rank clock
    return _outcome(lambda: dcp.save({"w": torch.ones(64, 64)}, storage_writer=ckptio.Writer(url)))


def async_saves(base: str, executor: str, overlap: bool = False, stager: int = 0) -> list[str]:
    """Three ``dcp.async_save`` calls with ``ckptio.Writer``: two new paths, then an overwrite of
    the first; every checkpoint loaded back. ``overlap``: none is awaited before the next starts
    (ckptio runs them one after the other), and a synchronous save follows at once. ``stager``:
    stage through one ``ckptio.Stager`` with that many slots (buffers reused across the saves)."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    kind = AsyncCheckpointerType.PROCESS if executor == "process" else AsyncCheckpointerType.THREAD
    gen = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(256, 1024, generator=gen), "step": torch.tensor(float(i))} for i in range(3)]
    targets = [(f"{base}/a", False), (f"{base}/b", False), (f"{base}/a", True)]
    futures = []
    staging = {"async_stager": ckptio.Stager(stager)} if stager else {}
    live = {"w": torch.zeros(256, 1024), "step": torch.tensor(0.0)}  # one state, changed after each save
    for (url, overwrite), state in zip(targets, states, strict=True):
        live["w"].copy_(state["w"])
        live["step"].copy_(state["step"])
        writer = ckptio.Writer(url, overwrite=overwrite)
        planner = ckptio.SavePlanner(enable_plan_caching=True)  # pickled to the PROCESS executor; plans cached
        futures.append(
            dcp.async_save(live, storage_writer=writer, planner=planner, async_checkpointer_type=kind, **staging)
        )
        if not overlap:
            futures[-1].result()
    expected = [(f"{base}/a", states[2]), (f"{base}/b", states[1])]
    if overlap:
        dcp.save(states[0], storage_writer=ckptio.Writer(f"{base}/c"))
        expected.append((f"{base}/c", states[0]))
        for future in futures:
            future.result()
    if staging:
        staging["async_stager"].close()
    wrong = []
    for url, state in expected:
        out = {"w": torch.zeros(256, 1024), "step": torch.tensor(-1.0)}
        dcp.load(out, storage_reader=ckptio.Reader(url))
        wrong += [f"{url}:{k}" for k in out if not torch.equal(out[k], state[k])]
    return wrong


def plain_async_saves(base: str, executor: str) -> tuple[list[str], int]:
    """The call torch documents, ``dcp.async_save(state, storage_writer=ckptio.Writer(url))``, four
    times, each awaited before the next; the state changes as soon as each call returns, so a save
    that read the live tensors (or buffers restaged by the next save) would store later values.
    The second save's target already holds a checkpoint: it fails in the background, and the next
    save must still go through. Returns what loaded wrong, and the staging buffer sets held."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from ckptio.saving import staging

    kind = AsyncCheckpointerType.PROCESS if executor == "process" else AsyncCheckpointerType.THREAD
    live = {"w": torch.zeros(256, 1024), "step": torch.tensor(0.0), "meta": {"epoch": 0}}
    urls = [f"{base}/0", f"{base}/0", f"{base}/2", f"{base}/3"]  # the second one exists by then
    expected, failures = {}, []
    for i, url in enumerate(urls):
        live["w"].fill_(float(i))
        live["step"].fill_(float(i))
        live["meta"]["epoch"] = i
        future = dcp.async_save(live, storage_writer=ckptio.Writer(url), async_checkpointer_type=kind)
        live["w"].fill_(-1.0)  # training goes on at once
        live["step"].fill_(-1.0)
        live["meta"]["epoch"] = -1
        try:
            future.result()
            expected.setdefault(url, (float(i), float(i), i))
        except BaseException as exc:  # noqa: BLE001 - torch raises CheckpointException, a BaseException
            failures.append((i, type(exc).__name__, str(exc)))
    wrong = [f"save {i} should have failed, got {f}" for i, *f in failures if i != 1]
    wrong += [] if [i for i, *_ in failures] == [1] else [f"expected save 1 to fail, failures: {failures}"]
    for url, (value, step, epoch) in expected.items():
        out = {"w": torch.zeros(256, 1024), "step": torch.tensor(-2.0), "meta": {"epoch": None}}
        dcp.load(out, storage_reader=ckptio.Reader(url))
        if not (torch.all(out["w"] == value) and out["step"].item() == step and out["meta"]["epoch"] == epoch):
            wrong.append(f"{url}: w={out['w'][0, 0].item()} step={out['step'].item()} meta={out['meta']}")
    return wrong, staging.writer_stager().buffer_sets


def stager_across_layout_changes(base: str, executor: str, plain: bool = False) -> list[str]:
    """Four async saves through one single-slot ``ckptio.Stager`` (``plain``: the Writer's own
    staging) while the state's layout changes: the same local shape under another placement
    (Shard(0) -> Replicate()), a new key, a new dtype. Staging into the buffers of the save
    before would keep the old placement or miss the new key."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    kind = AsyncCheckpointerType.PROCESS if executor == "process" else AsyncCheckpointerType.THREAD
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    local = torch.arange(16.0).reshape(4, 4) + 100 * rank
    shared = torch.arange(16.0).reshape(4, 4)  # the same on every rank, as Replicate() requires
    states = [
        {"w": DTensor.from_local(local, mesh, [Shard(0)])},
        {"w": DTensor.from_local(shared, mesh, [Replicate()])},
        {"w": DTensor.from_local(shared + 1, mesh, [Replicate()]), "b": torch.ones(3)},
        {"w": DTensor.from_local(shared + 2, mesh, [Replicate()]), "b": torch.ones(3, dtype=torch.float64)},
    ]
    stager = None if plain else ckptio.Stager(slots=1)
    for i, state in enumerate(states):
        future = dcp.async_save(
            state,
            storage_writer=ckptio.Writer(f"{base}/{i}"),
            async_checkpointer_type=kind,
            async_stager=stager,
        )
        future.result()
    if stager is not None:
        stager.close()
    wrong = []
    for i, state in enumerate(states):
        out = {
            k: (
                DTensor.from_local(torch.zeros(4, 4), mesh, v.placements)
                if isinstance(v, DTensor)
                else torch.zeros_like(v)
            )
            for k, v in state.items()
        }
        dcp.load(out, storage_reader=ckptio.Reader(f"{base}/{i}"))
        wrong += [
            f"save {i}: {k}"
            for k, v in state.items()
            if not torch.equal(getattr(out[k], "_local_tensor", out[k]), getattr(v, "_local_tensor", v))
        ]
    return wrong


def switch_mode_under_plan_cache(base: str) -> tuple[list[str], bool]:
    """A save in all_ranks mode, then one in replica_group mode of the same state with torch's plan
    cache on: the warnings ckptio logs on this rank, and whether the second save loads back exactly."""
    import logging

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("ckptio.saving.writer").addHandler(Collect())
    state = {"w": torch.arange(2048.0).reshape(64, 32)}  # replicated on both ranks
    for i, mode in enumerate(("all_ranks", "replica_group")):
        writer = ckptio.Writer(f"{base}/{i}", ckptio.WriterConfig(mode=mode))
        dcp.save(state, storage_writer=writer, planner=ckptio.SavePlanner(enable_plan_caching=True))
    out = {"w": torch.zeros(64, 32)}
    dcp.load(out, storage_reader=ckptio.Reader(f"{base}/1"))
    return messages, torch.equal(out["w"], state["w"])


class _RivalCommitsFirst(DefaultSavePlanner):
    """A second job saves to the same path after this one checked it and before this one commits."""

    def __init__(self, rival):
        super().__init__()
        self.rival = rival

    def finish_plan(self, plan):
        self.rival()
        return super().finish_plan(plan)


def race_two_saves(url: str, options=None) -> None:
    """Two saves to ``url``, the second committing between the first's check and commit: exactly one
    commits (the second), and the first fails with ``CheckpointExistsError``."""
    rival = {"w": torch.full((100,), 2.0)}
    planner = _RivalCommitsFirst(lambda: dcp.save(rival, storage_writer=ckptio.Writer(url, storage_options=options)))
    try:
        dcp.save(
            {"w": torch.full((100,), 1.0)}, storage_writer=ckptio.Writer(url, storage_options=options), planner=planner
        )
    except CheckpointException as exc:
        assert isinstance(ckptio.unwrap(exc), ckptio.CheckpointExistsError), exc
    else:
        raise AssertionError("the save that lost the race committed too")
    out = {"w": torch.zeros(100)}
    dcp.load(out, storage_reader=ckptio.Reader(url, storage_options=options))
    assert torch.equal(out["w"], rival["w"])  # the winner is intact and alone
