"""``--tiered-lagging``: tiered incremental saves made faster than the drain uploads them, on every S3 target.

The LoRA-shaped state of ``--incremental`` (a frozen bf16 base, 95% of the bytes; fp32 adapters with their
AdamW moments, 5%, changed every step), ``LAGGING_SIZE`` bytes (or ``--size``, if smaller) on the run's mesh,
saved ``--lagging-saves`` times about ``SAVE_EVERY_S`` apart with ``local_tier`` and
``incremental_from="previous"``: once with the drain limited (``drain_bandwidth``) to half the rate a full
save every ``SAVE_EVERY_S`` needs, once unlimited. Per save, from the S3 listings once ``wait_for_uploads()``
returned: the data bytes its folder holds (what its drain uploaded) against the bytes training changed; per
run, the most saves that waited to upload when a save began, the saves whose base was the save before (still
draining or not), and whether every step loads bit-exact from S3 alone.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import ckptio
from ckptio.format.names import METADATA_NAME
from ckptio.storage import open_store
from ckptio.tiers.drain import drain_queue

from . import counting
from .incremental import _state, _train
from .runner import mesh_of, report_progress
from .tiered import stats

#: The state's size (every rank's, replicas once): its saves must outrun a drain a 2-core machine's S3
#: emulator can serve.
LAGGING_SIZE = 48 << 20
SAVE_EVERY_S = 1.0
SAVES = 20
MiB = 1 << 20
MAX_DEPTH = ckptio.Tuning().incremental_max_depth  # the default, which the saves use


def run_rank(cfg: dict) -> list[dict]:
    rank = dist.get_rank()
    mesh = mesh_of(tuple(cfg["mesh"]), "cpu")
    size = cfg.get("lagging_size", LAGGING_SIZE)
    saves = cfg.get("lagging_saves", SAVES)
    writers = cfg["mesh"][1]  # replica_group mode: one replica group (a row of the mesh) writes
    full_rate = size / writers / SAVE_EVERY_S  # bytes per second a writing rank uploads for a full save each
    records = []
    for target in cfg["targets"]:
        for rep in range(cfg["repeats"]):
            for drain, bandwidth in (("half", int(full_rate / 2)), ("unlimited", None)):
                run = f"{target['base']}/lagging/{drain}/rep{rep}"
                tier = f"{cfg['tiered_fast_base']}/lagging-node{rank // max(1, cfg.get('ranks_per_node', 2))}"
                record = _run(run, tier, target.get("storage_options"), mesh, size, saves, bandwidth)
                records.append({**record, "target": target["name"], "drain": drain, "repeat": rep, "rank": rank})
                dist.barrier()
                if rank == 0 and not cfg["keep"]:
                    counting.remove(run, target.get("storage_options"))
                    shutil.rmtree(tier, ignore_errors=True)
                dist.barrier()
            report_progress(cfg, "lagging", target["name"], rep)
    return records


def _run(run: str, tier: str, options, mesh, size: int, saves: int, bandwidth: int | None) -> dict:
    state = _state("lora", size, mesh)
    config = ckptio.WriterConfig(
        mode="replica_group", local_tier=tier, incremental_from="previous", drain_bandwidth=bandwidth
    )
    changed, behind, expected, rss = [], [], [], []
    start = time.monotonic()
    for step in range(saves):
        if step:
            changed.append(_train("lora", size, state, step))
        due = start + step * SAVE_EVERY_S
        time.sleep(max(0.0, due - time.monotonic()))
        behind.append(len(drain_queue().backlog()[0]))
        dist.barrier()
        dcp.save(state, storage_writer=ckptio.Writer(f"{run}/step-{step}", config, storage_options=options))
        expected.append(_digests(state))  # not copies: the RSS measured is ckptio's
        rss.append(counting.rss())
    saving_s = time.monotonic() - start
    ckptio.wait_for_uploads()
    drained_s = time.monotonic() - start
    dist.barrier()
    uploaded, bases, depths = ([], [], []) if dist.get_rank() else _listed(run, options, saves)
    exact = all(_loads_exactly(f"{run}/step-{step}", options, mesh, size, expected[step]) for step in range(saves))
    return {
        "changed_bytes": changed,
        "uploaded_bytes": uploaded,
        "bases": bases,
        "depths": depths,
        "most_behind": max(behind),
        "saving_s": saving_s,
        "drained_s": drained_s,
        "bit_exact": exact,
        "rss_growth": rss[-1] - rss[1],  # after the second save (the first incremental one) to after the last
    }


def _listed(run: str, options, saves: int) -> tuple[list[int], list[str | None], list[int]]:
    """Per step, the data bytes its folder holds on S3, the base its document names and its chain depth."""
    uploaded, bases, depths = [], [], []
    for step in range(saves):
        url = f"{run}/step-{step}"
        files = counting.checkpoint_files(url, options)
        uploaded.append(sum(n for name, n in files.items() if name.endswith(".ckio")))
        chain = json.loads(open_store(url, options).read(METADATA_NAME)).get("chain")
        bases.append(chain and chain["base"])
        depths.append(chain["depth"] if chain else 0)
    return uploaded, bases, depths


def _loads_exactly(url: str, options, mesh, size: int, expected: dict) -> bool:
    target = _state("lora", size, mesh)
    for value in target.values():
        (value.to_local() if isinstance(value, DTensor) else value).zero_()
    dcp.load(target, storage_reader=ckptio.Reader(url, storage_options=options))
    return _digests(target) == expected


def _digests(state: dict) -> dict[str, str]:
    """Each tensor's local bytes, hashed."""
    out = {}
    for key, value in state.items():
        local = (value.to_local() if isinstance(value, DTensor) else value).contiguous()
        out[key] = hashlib.blake2b(local.view(-1).view(torch.uint8).numpy()).hexdigest()
    return out


def summarize(records: list[dict]) -> list[dict]:
    """One row per (target, drain): per save after the first, uploaded bytes against changed bytes (the
    worst save's ratio, and its slack against 1.05x changed + 1 MiB), medians (min-max) over repeats. A save
    full because its chain reached ``incremental_max_depth`` is counted apart: that is the chain's bound, not
    the drain's lag."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["target"], r["drain"])].append(r)
    rows = []
    for (target, drain), recs in groups.items():
        first = sorted((r for r in recs if r["rank"] == 0), key=lambda r: r["repeat"])
        worst, over_budget, referenced, restarts = [], [], [], []
        for r in first:
            depth_bound = [r["bases"][k] is None and r["depths"][k - 1] >= MAX_DEPTH for k in range(len(r["bases"]))]
            later = [
                (up, changed)
                for k, (up, changed) in enumerate(zip(r["uploaded_bytes"][1:], r["changed_bytes"], strict=True), 1)
                if not depth_bound[k]
            ]
            worst.append(max(up / changed for up, changed in later))
            over_budget.append(sum(up > 1.05 * changed + MiB for up, changed in later))
            referenced.append(sum(base == f"step-{k}" for k, base in enumerate(r["bases"][1:])))
            restarts.append(sum(depth_bound))
        rows.append(
            {
                "target": target,
                "drain": drain,
                "repeats": len(first),
                "saves": len(first[0]["uploaded_bytes"]),
                "full_save_bytes": first[0]["uploaded_bytes"][0],
                "changed_bytes": first[0]["changed_bytes"][0],
                "uploaded_over_changed_worst": stats(worst),
                "saves_over_budget": max(over_budget),
                "saves_on_the_one_before": stats(referenced),
                "full_by_depth_bound": max(restarts),
                "most_behind": stats(_slowest(recs, "most_behind")),
                "drained_s": stats(_slowest(recs, "drained_s")),
                "rss_growth_mib": max(r["rss_growth"] for r in recs) / MiB,  # the rank that grew most
                "bit_exact": all(r["bit_exact"] for r in recs),
            }
        )
    return rows


def _slowest(recs: list[dict], field: str) -> list[float]:
    """Per repeat, the largest ``field`` over the ranks."""
    by_repeat: dict[int, list[float]] = defaultdict(list)
    for r in recs:
        by_repeat[r["repeat"]].append(r[field])
    return [max(values) for _, values in sorted(by_repeat.items())]


def table(rows: list[dict]) -> str:
    if not rows:
        return ""
    lines = [
        "| target | drain | saves | full save | changed/save | uploaded/changed (worst save) | saves over 1.05x+1MiB "
        f"| full by the chain's depth bound ({MAX_DEPTH}) | based on the save before | most saves waiting "
        "| all drained after | RSS growth | bit-exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['target']} | {r['drain']} | {r['saves']} | {r['full_save_bytes'] / MiB:.1f} MiB "
            f"| {r['changed_bytes'] / MiB:.2f} MiB | {_stat(r['uploaded_over_changed_worst'], 'x', 3)} "
            f"| {r['saves_over_budget']} | {r['full_by_depth_bound']} "
            f"| {_stat(r['saves_on_the_one_before'], '', 0)} of {r['saves'] - 1 - r['full_by_depth_bound']} "
            f"| {_stat(r['most_behind'], '', 0)} | {_stat(r['drained_s'], ' s', 1)} | {r['rss_growth_mib']:+.0f} MiB "
            f"| {r['bit_exact']} |"
        )
    return "\n".join(lines)


def _stat(s: dict, unit: str, digits: int) -> str:
    return f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
