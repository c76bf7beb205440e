"""``--incremental``: incremental saves (``WriterConfig.incremental_from``) beside full saves of the same
state, on every target.

Three states of about ``--size`` bytes on the run's mesh, each changed in place between two saves as
training changes it:

- ``lora``: a frozen bf16 base model (95% of the bytes) and trainable fp32 adapters with their AdamW
  moments (5%), which change every step;
- ``sparse``: an fp32 embedding table with its two AdamW moments, of which 1% of the rows change;
- ``full``: the benchmark's model and moments (``randn``), every value changed every step.

Per state, target and repeat: a chain is started with a save that records digests (``step-0``); the
state changes; its next step is saved both in full (``full-1``) and incrementally against ``step-0``
(``step-1``), in alternating order; both are loaded on the save mesh (and at repeat 0 resharded), timed
and checked bit-exact; then the chain goes on to the depth bound (``--incremental-depth``) and its last link is
loaded against a full save of the same state. Bytes and objects written per save come from the listings
(an incremental save's markers in its base's folder included).
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard

import ckptio
from ckptio.format.names import METADATA_NAME, reference_marker_name
from ckptio.storage import open_store

from . import counting, workload
from .runner import mesh_of, report_progress
from .tiered import stats

STATES = ("lora", "sparse", "full")
#: The chain's bound in this section (``--incremental-depth``): the last link loaded is this deep.
MAX_DEPTH = 4
COLS = workload.COLS
#: Share of the lora state's bytes in its trainable adapters (weights and two AdamW moments).
ADAPTER_SHARE = 0.05
#: Share of the sparse table's rows that change between two saves.
SPARSE_ROWS = 0.01
#: Incremental saves in a row whose memory is followed (growth from after the first to after the last).
MEMORY_SAVES = 6


def _specs(kind: str, size: int) -> list[tuple[workload.Spec, bool]]:
    """``(spec, trainable)`` of each tensor of the state ``kind``."""
    if kind == "full":
        return [(spec, True) for spec in workload.tensor_specs(size, "randn")]
    if kind == "sparse":
        rows = max(100, int(size / 3 / 4 / COLS))
        names = [f"model.embedding{suffix}" for suffix in ("", ".exp_avg", ".exp_avg_sq")]
        return [(workload.Spec(name, rows, torch.float32), True) for name in names]
    frozen_rows = int(size * (1 - ADAPTER_SHARE) / 2 / COLS / 8)
    adapter_rows = max(1, int(size * ADAPTER_SHARE / 12 / COLS / 8))
    specs = [(workload.Spec(f"model.layers.{i}.weight", frozen_rows, torch.bfloat16), False) for i in range(8)]
    for i in range(8):
        for suffix in ("", ".exp_avg", ".exp_avg_sq"):
            specs.append((workload.Spec(f"model.layers.{i}.lora{suffix}", adapter_rows, torch.float32), True))
    return specs


def _state(kind: str, size: int, mesh) -> dict:
    shards = mesh.size(mesh.mesh_dim_names.index("shard"))
    index = mesh.get_local_rank("shard")
    state = {}
    for spec, _ in _specs(kind, size):
        a, b = workload.shard_rows(spec.rows, shards, index)
        local = workload.rows_of(spec, a, b, "randn")
        state[spec.name] = DTensor.from_local(
            local, mesh, [Replicate(), Shard(0)], run_check=False, shape=torch.Size((spec.rows, COLS)), stride=(COLS, 1)
        )
    state["step"] = torch.tensor(0)
    return state


def _train(kind: str, size: int, state: dict, step: int) -> int:
    """Change ``state`` as step ``step`` of training would; the logical bytes of its changed items
    (every rank's, replicas counted once)."""
    changed = 0
    for spec, trainable in _specs(kind, size):
        if not trainable:
            continue
        value = state[spec.name]
        local = value.to_local()
        row_bytes = COLS * spec.dtype.itemsize
        if kind == "sparse":
            mesh = value.device_mesh
            start = workload.shard_rows(spec.rows, mesh.size(1), mesh.get_local_rank("shard"))[0]
            count = max(1, int(spec.rows * SPARSE_ROWS))
            rows = {zlib.crc32(f"{step}:{k}".encode()) % spec.rows for k in range(count)}
            for row in rows:
                if start <= row < start + local.shape[0]:
                    local[row - start] += 1
            changed += len(rows) * row_bytes
        else:
            local += 1
            changed += spec.rows * row_bytes
    state["step"] += 1
    return changed


def run_rank(cfg: dict) -> list[dict]:
    rank = dist.get_rank()
    mesh = mesh_of(tuple(cfg["mesh"]), "cpu")
    reshard_mesh = mesh_of((cfg["mesh"][0] * cfg["mesh"][1], 1), "cpu")
    records = []
    for kind in cfg.get("incremental_states", STATES):
        state = _state(kind, cfg["size_bytes"], mesh)
        for target in cfg["targets"]:
            run = _Run(cfg, target, kind, rank)
            for rep in range(cfg["repeats"]):
                records.append(run.repeat(rep, state, mesh, reshard_mesh))
                report_progress(cfg, "incremental", kind, target["name"], rep)
            records.append(run.memory_over_saves(state, cfg.get("incremental_memory_saves", MEMORY_SAVES)))
    return records


class _Run:
    def __init__(self, cfg: dict, target: dict, kind: str, rank: int):
        self.cfg, self.target, self.kind, self.rank = cfg, target, kind, rank
        self.options = target.get("storage_options")
        self.depth = cfg.get("incremental_depth", MAX_DEPTH)
        self.chain = ckptio.WriterConfig(
            mode="replica_group",
            incremental_from="previous",
            tuning=ckptio.Tuning(incremental_max_depth=self.depth),
        )
        self.plain = ckptio.WriterConfig(mode="replica_group")

    def repeat(self, rep: int, state: dict, mesh, reshard_mesh) -> dict:
        base = f"{self.target['base']}/incremental/{self.kind}/rep{rep}"
        record = {"target": self.target["name"], "state": self.kind, "repeat": rep, "rank": self.rank}
        self._save(f"{base}/step-0", state, self.chain)
        record["changed_bytes"] = _train(self.kind, self.cfg["size_bytes"], state, 1)
        first_full = rep % 2 == 0
        for which in ("full", "incremental") if first_full else ("incremental", "full"):
            url = f"{base}/full-1" if which == "full" else f"{base}/step-1"
            config = self.plain if which == "full" else self._against(f"{base}/step-0")
            record[f"{which}_save_s"], record[f"{which}_save_cpu_s"] = self._save(url, state, config)
            record[f"{which}_written"] = self._written(url)
        snapshot = {k: (v.to_local().clone() if isinstance(v, DTensor) else v.clone()) for k, v in state.items()}
        for which, url in (("full", f"{base}/full-1"), ("incremental", f"{base}/step-1")):
            record[f"{which}_load_s"], record[f"{which}_mismatches"] = self._load(url, snapshot, mesh)
            if rep == 0:
                record[f"{which}_reshard_load_s"], _ = self._load(url, None, reshard_mesh)
        # on to the depth bound (step-1 was saved against step-0: depth 1)
        for step in range(2, self.depth + 1):
            _train(self.kind, self.cfg["size_bytes"], state, step)
            self._save(f"{base}/step-{step}", state, self._against(f"{base}/step-{step - 1}"))
        self._save(f"{base}/full-deep", state, self.plain)
        snapshot = {k: (v.to_local().clone() if isinstance(v, DTensor) else v.clone()) for k, v in state.items()}
        record["deep_full_load_s"], _ = self._load(f"{base}/full-deep", snapshot, mesh)
        deep = self._load(f"{base}/step-{self.depth}", snapshot, mesh)
        record["deep_incremental_load_s"], record["deep_mismatches"] = deep
        record["deep_depth"] = self._depth(f"{base}/step-{self.depth}")
        dist.barrier()
        if self.rank == 0 and not self.cfg["keep"]:
            counting.remove(base, self.options)
        dist.barrier()
        return record

    def memory_over_saves(self, state: dict, saves: int) -> dict:
        """This rank's RSS after each of ``saves`` incremental saves in a row, the state trained between."""
        base = f"{self.target['base']}/incremental/{self.kind}/memory"
        rss = []
        for step in range(saves):
            if step:
                _train(self.kind, self.cfg["size_bytes"], state, 100 + step)
            config = self._against(f"{base}/step-{step - 1}") if step else self.chain
            self._save(f"{base}/step-{step}", state, config)
            rss.append(counting.rss())
        dist.barrier()
        if self.rank == 0 and not self.cfg["keep"]:
            counting.remove(base, self.options)
        dist.barrier()
        return {"target": self.target["name"], "state": self.kind, "rank": self.rank, "memory": rss}

    def _against(self, base_url: str) -> ckptio.WriterConfig:
        return dataclasses.replace(self.chain, incremental_from=base_url)

    def _save(self, url: str, state: dict, config) -> tuple[float, float]:
        dist.barrier()
        cpu, start = counting.cpu_seconds(), counting.now()
        dcp.save(state, storage_writer=ckptio.Writer(url, config, storage_options=self.options))
        elapsed, cpu = counting.now() - start, counting.cpu_seconds() - cpu
        dist.barrier()
        return elapsed, cpu

    def _load(self, url: str, expected: dict | None, mesh) -> tuple[float, list[str]]:
        target = _state(self.kind, self.cfg["size_bytes"], mesh)
        for value in target.values():
            (value.to_local() if isinstance(value, DTensor) else value).zero_()
        dist.barrier()
        start = counting.now()
        dcp.load(target, storage_reader=ckptio.Reader(url, storage_options=self.options))
        elapsed = counting.now() - start
        dist.barrier()
        if expected is None:
            return elapsed, []
        wrong = [
            k for k, v in target.items() if not torch.equal(v.to_local() if isinstance(v, DTensor) else v, expected[k])
        ]
        return elapsed, wrong

    def _written(self, url: str) -> dict:
        """Bytes and objects a save left: its folder's, and its markers in the folders it references."""
        if self.rank != 0:
            return {}
        files = counting.checkpoint_files(url, self.options)
        data = sum(size for name, size in files.items() if name.endswith(".ckio"))
        total, objects = sum(files.values()), len(files)
        store = open_store(url, self.options)
        for name in self._bases(url):
            marker = store.sibling(name)
            size = marker.list_sizes().get(reference_marker_name(url.rstrip("/").rsplit("/", 1)[1]), 0)
            total, objects = total + size, objects + 1
        return {"data_bytes": data, "bytes": total, "objects": objects}

    def _bases(self, url: str) -> list[str]:
        return [b["name"] for b in self._document(url)["files"].get("bases", [])]

    def _depth(self, url: str) -> int:
        return (self._document(url).get("chain") or {}).get("depth", 0)

    def _document(self, url: str) -> dict:
        return json.loads(open_store(url, self.options).read(METADATA_NAME))


#: Per-repeat times summarized: the slowest rank's.
TIMES = (
    "full_save_s",
    "incremental_save_s",
    "full_load_s",
    "incremental_load_s",
    "deep_full_load_s",
    "deep_incremental_load_s",
)
RATIOS = (
    ("save_time", "incremental_save_s", "full_save_s"),
    ("load_time_depth_1", "incremental_load_s", "full_load_s"),
    ("load_time_at_bound", "deep_incremental_load_s", "deep_full_load_s"),
)


def summarize(records: list[dict]) -> list[dict]:
    """One row per (state, target): medians (min-max) over repeats of the slowest rank's times, ratios
    per repeat, CPU summed over ranks, bytes and objects written, bit-exactness."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["state"], r["target"])].append(r)
    rows = []
    for (kind, target), recs in groups.items():
        reps: dict[int, list[dict]] = defaultdict(list)
        for r in recs:
            if "repeat" in r:
                reps[r["repeat"]].append(r)
        memory = [r["memory"] for r in recs if "memory" in r]
        order = sorted(reps)
        slowest = {f: [max(r[f] for r in reps[k]) for k in order] for f in TIMES}
        row: dict = {"state": kind, "target": target, "repeats": len(order)}
        for f, values in slowest.items():
            row[f] = stats(values)
        for name, top, bottom in RATIOS:
            row[name] = stats([a / b for a, b in zip(slowest[top], slowest[bottom], strict=True)])
        cpu = {w: [sum(r[f"{w}_save_cpu_s"] for r in reps[k]) for k in order] for w in ("full", "incremental")}
        row["save_cpu"] = stats([a / b for a, b in zip(cpu["incremental"], cpu["full"], strict=True)])
        first = [next(r for r in reps[k] if r["rank"] == 0) for k in order]
        row["changed_bytes"] = first[0]["changed_bytes"]
        for w in ("full", "incremental"):
            row[f"{w}_written"] = first[0][f"{w}_written"]
        row["written_bytes"] = stats([f["incremental_written"]["bytes"] / f["full_written"]["bytes"] for f in first])
        row["data_over_changed"] = first[0]["incremental_written"]["data_bytes"] / max(1, first[0]["changed_bytes"])
        if "full_reshard_load_s" in first[0]:
            row["reshard_load_time"] = max(r["incremental_reshard_load_s"] for r in reps[order[0]]) / max(
                r["full_reshard_load_s"] for r in reps[order[0]]
            )
        row["rss_growth_bytes"] = max(m[-1] - m[0] for m in memory)  # the rank that grew most
        row["rss_growth_saves"] = len(memory[0])
        row["deep_depth"] = first[0]["deep_depth"]
        row["bit_exact"] = all(
            not (r["full_mismatches"] or r["incremental_mismatches"] or r["deep_mismatches"])
            for k in order
            for r in reps[k]
        )
        rows.append(row)
    return rows
