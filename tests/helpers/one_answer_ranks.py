"""Rank bodies for issue 65's findings: decisions that every rank must take the same way (which document a
load reads, whether a save is refused, which step ``latest`` names), on gloo ranks."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.tools.cli import main as cli_main
from tests.helpers.fragment_ranks import only_fragments

N = 1 << 15  # fp32 elements a tensor: past the inline limit


def _state(value: float) -> dict:
    return {"a": torch.full((N,), value), "b": torch.arange(float(N)) + value, "step": int(value)}


def _blank() -> dict:
    return {"a": torch.zeros(N), "b": torch.zeros(N), "step": -1}


def _exact(loaded: dict, value: float) -> bool:
    want = _state(value)
    return all(torch.equal(loaded[k], want[k]) for k in ("a", "b")) and loaded["step"] == want["step"]


def load_while_the_merge_commits(url: str) -> bool:
    """Finding 5: a save without a coordinator; its fragments alone at the URL. Rank 1 reads them at once
    (and waits in the load for rank 0), rank 0 commits their merge first (as its background merge does),
    then reads that ``ckptio.json``: the two ranks read different documents. Both must load the values."""
    dcp.save(_state(3.0), storage_writer=ckptio.Writer(url), use_collectives=False)
    if dist.get_rank() == 0:
        only_fragments(url)
    dist.barrier()
    if dist.get_rank() == 0:
        time.sleep(1.0)  # rank 1 has read the fragments by now
        assert cli_main(["merge", url]) == 0
    loaded = _blank()
    dcp.load(loaded, storage_reader=ckptio.Reader(url))
    return _exact(loaded, 3.0)


# --- tiered lifecycles: rank r runs on node r (two nodes of one rank each, unless said) -----------------------
#: A drain that cannot finish (the job is killed before it): 1 byte/s, given up after half a second.
STALLED = {"drain_bandwidth": 1, "tuning": ckptio.Tuning(drain_timeout_s=0.5)}


def _node(tiers: str, ranks_per_node: int = 1) -> str:
    node = dist.get_rank() // ranks_per_node
    os.environ["CKPTIO_NODE"] = f"node{node}"
    return os.path.join(tiers, f"node{node}")


def _tiered_save(url: str, value: float, tier: str, options: dict, stalled: bool = False, **config) -> None:
    cfg = ckptio.WriterConfig(local_tier=tier, **(STALLED if stalled else {}), **config)
    dcp.save(_state(value), storage_writer=ckptio.Writer(url, cfg, storage_options=options))
    try:
        ckptio.wait_for_uploads()
    except ckptio.DrainError:
        assert stalled, "a drain failed"


def _load(url: str, tier: str | None, options: dict) -> float | str:
    """The value a load returns, or the name of the ``CheckpointError`` it raised."""
    loaded = _blank()
    try:
        dcp.load(loaded, storage_reader=ckptio.Reader(url, local_tier=tier, storage_options=options))
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException
        error = ckptio.unwrap(exc)
        assert isinstance(error, ckptio.CheckpointError), repr(error)
        return type(error).__name__
    value = float(loaded["a"][0])
    assert _exact(loaded, value), "a load returned values no save wrote"
    return value


def partner_copy_after_delete_and_save_again(run: str, tiers: str, options: dict) -> tuple:
    """Finding 2: node B kept a partner copy of step-5 (V1), which was drained, deleted, and saved again
    (V2) from the same nodes; V2's drain and copies never finished and node A was lost. Neither ``latest``
    nor a load of step-5 may serve V1."""
    import shutil

    tier = _node(tiers)
    _tiered_save(f"{run}/step-4", 40.0, tier, options, local_tier_copies=2)
    _tiered_save(f"{run}/step-5", 51.0, tier, options, local_tier_copies=2)
    dist.barrier()  # every rank has seen step-5 commit
    if dist.get_rank() == 0:
        assert cli_main(["delete", "--force", f"{run}/step-5", "--storage-options", _json(options)]) == 0
    dist.barrier()
    _tiered_save(f"{run}/step-5", 52.0, tier, options, stalled=True, overwrite=True)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(tier)  # node A is lost
    dist.barrier()
    url = ckptio.latest(run, local_tier=tier, storage_options=options)
    return url, _load(url, tier, options), _load(f"{run}/step-5", tier, options)


def restart_saves_the_step_latest_passed_over(run: str, tiers: str, options: dict) -> tuple:
    """Finding 3: step-11's drain was cut off and node B lost; ``latest`` names step-10; the job resumes
    there and saves step-11 again, without ``overwrite``, on every rank."""
    import shutil

    tier = _node(tiers)
    _tiered_save(f"{run}/step-10", 10.0, tier, options)
    _tiered_save(f"{run}/step-11", 11.0, tier, options, stalled=True)
    dist.barrier()
    if dist.get_rank() == 1:
        shutil.rmtree(tier)  # node B is lost
    dist.barrier()
    url = ckptio.latest(run, local_tier=tier, storage_options=options)
    resumed = _load(url, tier, options)
    removable = None
    if dist.get_rank() == 0:  # what gc would remove on node A: the step latest passed over
        from ckptio.tools.tier_status import node_steps

        removable = [s.step for s in node_steps(run, tier, options, keep=5) if s.removable]
    _tiered_save(f"{run}/step-11", 111.0, tier, options)
    return url, resumed, removable, _load(f"{run}/step-11", tier, options)


def _json(options: dict) -> str:
    import json

    return json.dumps(options)


def requeue_attempt(run: str, tiers: str, options: dict, attempt: int) -> tuple:
    """Finding 6: 4 ranks on 2 nodes, copies on the partner node, saves without a coordinator, one
    ``CKPTIO_JOB_ID``. Attempt 1 saves step-1 (committed) and step-2, whose drain is cut off with rank 3's
    fragment lost everywhere; attempt 2 restarts from ``latest`` and saves step-2 again, on every rank."""
    from ckptio.saving.merge_once import settle

    tier = _node(tiers, ranks_per_node=2)
    config = {"local_tier": tier, "local_tier_copies": 2}
    rank = dist.get_rank()

    def save(step: int, value: float, stalled: bool = False) -> None:
        cfg = ckptio.WriterConfig(**config, **(STALLED if stalled else {}))
        writer = ckptio.Writer(f"{run}/step-{step}", cfg, storage_options=options)
        dcp.save(_state(value), storage_writer=writer, use_collectives=False)

    if attempt == 1:
        save(1, 1.0)
        ckptio.wait_for_uploads()
        dist.barrier()
        save(2, 2.0, stalled=rank == 3)
        from ckptio.tiers.drain import drain_queue
        from ckptio.tiers.replication import wait_for_copies

        try:
            drain_queue().wait(60)
        except ckptio.DrainError:
            assert rank == 3
        wait_for_copies(60)
        settle(f"{run}/step-2")  # the job is killed: its merge never comes
        dist.barrier()
        from ckptio.tiers.paths import local_step_path

        folder = local_step_path(tier, f"{run}/step-2", options)
        lost = os.path.join(folder, "ckptio.rank-00003-of-00004.json")
        with contextlib.suppress(FileNotFoundError):  # both ranks of a node remove it
            os.remove(lost)  # rank 3's fragment is lost on both nodes
        return None
    url = ckptio.latest(run, local_tier=tier, storage_options=options)
    resumed = _load(url, tier, options)
    save(2, 22.0)
    ckptio.wait_for_uploads()
    dist.barrier()
    return (
        url,
        resumed,
        _load(f"{run}/step-2", tier, options),
        ckptio.latest(run, local_tier=tier, storage_options=options),
    )


# --- the lifecycle of a job on two nodes (``test_nodes_lifecycle.py``) ----------------------------------------
def run_program(run: str, tiers: str, options: dict, program: list[tuple]) -> list:
    """Run ``program`` (a list of operations, the same on both ranks; rank r on node r; a save's copies on the
    other node as it says) and return what each operation saw: a save ``"saved"`` or the error's name, a load
    the value or the error's name, a restart ``(step, value)``. Every rank must see the same."""
    import shutil
    import time

    from ckptio.tiers.node_notes import CLOCK_SKEW_S
    from ckptio.tiers.paths import local_step_path

    tier = _node(tiers)
    seen: list = []
    for op in program:
        if os.environ.get("CKPTIO_TRACE_OPS"):
            print(f"rank {dist.get_rank()} {time.time():.2f} {op}", file=sys.stderr, flush=True)
        kind = op[0]
        if kind == "save":
            _, step, value, collectives, finishes, overwrite, copies = op
            cfg = ckptio.WriterConfig(
                local_tier=tier, local_tier_copies=copies, overwrite=overwrite, **({} if finishes else STALLED)
            )
            writer = ckptio.Writer(f"{run}/step-{step}", cfg, storage_options=options)
            # Nodes order saves by their clocks, which may differ by CLOCK_SKEW_S: saves closer than that to the
            # one before are not told apart (a restart after a cut-off save takes seconds).
            time.sleep(CLOCK_SKEW_S + 0.05)
            try:
                dcp.save(_state(float(value)), storage_writer=writer, use_collectives=collectives)
                seen.append("saved")
            except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException
                seen.append(type(ckptio.unwrap(exc)).__name__)
            try:
                ckptio.wait_for_uploads()
            except ckptio.DrainError:
                pass
        elif kind == "delete":
            if dist.get_rank() == 0:
                cli_main(["delete", "--force", f"{run}/step-{op[1]}", "--storage-options", _json(options)])
            seen.append(None)
        elif kind == "lose":
            if dist.get_rank() == op[1]:
                shutil.rmtree(tier, ignore_errors=True)
            seen.append(None)
        elif kind == "damage":
            _, node, step = op
            folder = local_step_path(tier, f"{run}/step-{step}", options)
            if dist.get_rank() == node and os.path.isdir(folder):
                for name in os.listdir(folder):
                    if name == "ckptio.json" or name.startswith("ckptio.rank-"):
                        with open(os.path.join(folder, name), "r+b") as f:
                            f.truncate(os.path.getsize(os.path.join(folder, name)) // 2)
            seen.append(None)
        elif kind == "restart":
            url = ckptio.latest(run, local_tier=tier, storage_options=options)
            value = _load(url, tier, options) if url else None
            try:
                ckptio.wait_for_uploads()  # the resumed drain commits
            except ckptio.DrainError:
                pass
            seen.append((int(url.rsplit("-", 1)[1]) if url else None, value))
        elif kind == "load":
            seen.append(_load(f"{run}/step-{op[1]}", tier, options))
        if os.environ.get("CKPTIO_TRACE_OPS"):
            print(f"rank {dist.get_rank()} {time.time():.2f} saw {seen[-1]}", file=sys.stderr, flush=True)
        dist.barrier()
    return seen
