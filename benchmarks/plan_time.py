"""``--plan-tensors 100,10000``: how long a save plans, the first time and once torch's plan cache
(``enable_plan_caching=True``) holds the plans, for ckptio (with ``ckptio.SavePlanner``) and torch's
writer (with ``DefaultSavePlanner``).

The state is many small DTensors, so planning (local plans, the gather of plans and of ckptio's
Holdings, the global plan, the scatter) is most of a save. Plan time is measured from the call to
``dcp.save`` until this rank's ``write_data`` starts; save time is the whole call.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor, Replicate, Shard

import ckptio

from . import counting
from .runner import mesh_of, remove_together, report_progress

SAVES = 5
TENSOR_SHAPE = (16, 64)
#: name -> (writer for a URL, the planner its users get)
WRITERS = {
    "ckptio all_ranks": (lambda url: ckptio.Writer(url), ckptio.SavePlanner),
    "torch FileSystemWriter": (lambda url: dcp.FileSystemWriter(url), DefaultSavePlanner),
}


def small_tensor_state(count: int, mesh) -> dict:
    """``count`` fp32 DTensors of TENSOR_SHAPE, sharded over the mesh's last dimension."""
    rows = TENSOR_SHAPE[0] // mesh.size(mesh.ndim - 1)
    local = torch.ones(rows, TENSOR_SHAPE[1])
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    return {
        f"layers.{i // 10}.w{i % 10}": DTensor.from_local(
            local, mesh, placements, run_check=False, shape=torch.Size(TENSOR_SHAPE), stride=(TENSOR_SHAPE[1], 1)
        )
        for i in range(count)
    }


def _timed_save(state: dict, writer, planner) -> tuple[float, float]:
    """(plan seconds, save seconds) of one ``dcp.save`` on this rank."""
    started: list[float] = []
    write_data = writer.write_data

    def timed_write_data(*args, **kwargs):
        started.append(counting.now())
        return write_data(*args, **kwargs)

    writer.write_data = timed_write_data  # an instance attribute: DCP calls it, the class is untouched
    dist.barrier()
    start = counting.now()
    dcp.save(state, storage_writer=writer, planner=planner)
    end = counting.now()
    return started[0] - start, end - start


def run_rank(cfg: dict) -> list[dict]:
    rank = dist.get_rank()
    mesh = mesh_of(tuple(cfg["mesh"]), cfg["device"])
    records = []
    for count in cfg["plan_tensors"]:
        state = small_tensor_state(count, mesh)
        for name, (make_writer, planner_base) in WRITERS.items():
            # torch keys its plan cache by planner class: one class per run keeps the runs apart
            planner_class = type(f"Planner_{name.split()[0]}_{count}", (planner_base,), {})
            for k in range(SAVES):
                url = f"{cfg['plan_base']}/{name.split()[0]}-{count}/save{k}"
                plan_s, save_s = _timed_save(state, make_writer(url), planner_class(enable_plan_caching=True))
                records.append(
                    {"writer": name, "tensors": count, "save": k, "rank": rank, "plan_s": plan_s, "save_s": save_s}
                )
                remove_together(url)
            report_progress(cfg, "plan", name, count)
    return records


def summarize(records: list[dict]) -> list[dict]:
    """Per (writer, tensors): the slowest rank's plan and save time of save 1, and of saves 2..N
    (median, min-max)."""
    by: dict[tuple[str, int], dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by[(r["writer"], r["tensors"])][r["save"]].append(r)
    rows = []
    for (writer, tensors), saves in by.items():
        plan = [max(r["plan_s"] for r in saves[k]) for k in sorted(saves)]
        total = [max(r["save_s"] for r in saves[k]) for k in sorted(saves)]
        later_plan, later_total = plan[1:] or plan, total[1:] or total
        rows.append(
            {
                "writer": writer,
                "tensors": tensors,
                "saves": len(plan),
                "first_plan_s": plan[0],
                "later_plan_s_median": statistics.median(later_plan),
                "later_plan_s_min": min(later_plan),
                "later_plan_s_max": max(later_plan),
                "first_save_s": total[0],
                "later_save_s_median": statistics.median(later_total),
            }
        )
    return rows
