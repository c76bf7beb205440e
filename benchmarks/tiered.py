"""The tiered section: a node-local fast tier drained to S3, against direct saves of the same state.

On each S3 target, per repeat and rank: a direct sync save to S3, a local-only save to the fast
tier's disk, a tiered sync save (its blocking time, then the drain with a training-step loop
running beside it), a tiered save without a coordinator (``use_collectives=False``: blocking time),
the plain ``dcp.async_save`` of a direct and of a tiered save (blocking time), ``ckptio.latest`` and
a restart load from the fast tier against a load of the same checkpoint from S3; a tiered save whose
files are copied to the other node (``local_tier_copies=2``: blocking time, bytes sent), and a restart
(``latest`` and the load) after the last node was lost while that save's drain was cut off, one with
every node's fast tier, and a load of the same step from S3. After the repeats, one load with the last
rank's fast tier empty (how many bytes S3 served to it and to the others) and tiered saves in a row
(memory). Ranks are grouped into simulated nodes of one replica group each (the ranks of a node share its
fast-tier path and its ``CKPTIO_NODE``, as on a real node).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections import defaultdict

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.tiers import replication
from ckptio.tiers.paths import local_step_path

from . import counting, workload
from .async_saves import TrainingStep
from .runner import rank_state, report_progress

#: The save mode of every save here: the one the README recommends for S3 (only the first replica
#: group uploads; on a tiered save, every rank still keeps all it holds on its node).
MODE = "replica_group"
#: Before each measurement the S3 server (when it runs here) must have used less than IDLE_SHARE of
#: a core over a window of SETTLE_WINDOW_S, or SETTLE_MAX_S have passed.
SETTLE_WINDOW_S, IDLE_SHARE, SETTLE_MAX_S = 0.1, 0.05, 5.0
#: Seconds of the training-step loop with no save, before each tiered save and after its drain.
BASELINE_S = 1.0
#: Longest wait for a drain (an S3 server that stops answering fails the run instead of hanging it).
DRAIN_TIMEOUT_S = 600.0
#: Tiered saves in a row whose memory is followed (growth from after the first to after the last).
MEMORY_SAVES = 8


def run_rank(cfg: dict) -> list[dict]:
    """Per target, one record per repeat of this rank's figures, one of the emptied-tier load and
    one of the memory over saves in a row."""
    rank, mesh, specs, state = rank_state(cfg)
    node_tier = os.path.join(cfg["tiered_fast_base"], f"node{rank // cfg['mesh'][1]}")
    os.environ["CKPTIO_NODE"] = f"node{rank // cfg['mesh'][1]}"
    step = TrainingStep()
    records = []
    for target in cfg["targets"]:
        if target["kind"] != "s3":
            continue
        run = _Run(cfg, target, node_tier, rank)
        run.warm_up(state)
        for rep in range(cfg["repeats"]):
            records.append(run.repeat(rep, state, mesh, specs, step))
            report_progress(cfg, "tiered", target["name"], rep)
        records.append(run.emptied_tier_load(cfg["repeats"] - 1, mesh, specs))
        records.append(run.memory_over_saves(state, MEMORY_SAVES))
        run.remove_all()
    return records


class _Run:
    """One target's tiered runs: its URLs and the configs of the three writers compared."""

    def __init__(self, cfg: dict, target: dict, node_tier: str, rank: int):
        self.cfg, self.target, self.node_tier, self.rank = cfg, target, node_tier, rank
        self.options = target.get("storage_options") or {}
        self.base = f"{target['base']}/tiered"
        self.local_base = os.path.join(cfg["tiered_fast_base"], "local-only", target["name"].replace(" ", "_"))
        self.direct = ckptio.WriterConfig(mode=MODE)
        self.tiered = ckptio.WriterConfig(mode=MODE, local_tier=node_tier)
        self.copied = ckptio.WriterConfig(mode=MODE, local_tier=node_tier, local_tier_copies=2)

    def _writer(self, url: str, config: ckptio.WriterConfig | None = None) -> ckptio.Writer:
        return ckptio.Writer(url, config or self.direct, storage_options=self.options)

    def warm_up(self, state: dict) -> None:
        """One untimed save of each kind: clients, sessions, the drain thread, the executor of
        ``dcp.async_save`` and imports start here."""
        dcp.save(state, storage_writer=self._writer(f"{self.base}/warmup/direct"))
        dcp.save(state, storage_writer=self._writer(f"{self.base}/warmup/run/step-0", self.tiered))
        self._async_blocking(state, self._writer(f"{self.base}/warmup/direct-async"))
        self._async_blocking(state, self._writer(f"{self.base}/warmup/run/step-1", self.tiered))
        if self._nodes() > 1:  # the first copied save makes the group the copies travel over
            dcp.save(state, storage_writer=self._writer(f"{self.base}/warmup/run/step-2", self.copied))
        ckptio.wait_for_uploads(DRAIN_TIMEOUT_S)
        self._remove_on_rank0(f"{self.base}/warmup", self.options)

    def repeat(self, rep: int, state: dict, mesh, specs, step: TrainingStep) -> dict:
        record = {"target": self.target["name"], "repeat": rep, "rank": self.rank}
        direct_url = f"{self.base}/direct/rep{rep}"
        record["direct_save_s"] = self._timed(lambda: dcp.save(state, storage_writer=self._writer(direct_url)))
        local_url = os.path.join(self.local_base, f"rep{rep}")
        record["local_save_s"] = self._timed(
            lambda: dcp.save(state, storage_writer=ckptio.Writer(local_url, self.direct))
        )

        before = self._steps_per_s(step)
        url = f"{self.base}/run/step-{2 * rep + 1}"
        record["tiered_save_s"] = self._timed(lambda: dcp.save(state, storage_writer=self._writer(url, self.tiered)))
        steps, drain_s = step.run_until(lambda: ckptio.uploads_pending() == 0)
        ckptio.wait_for_uploads(DRAIN_TIMEOUT_S)  # raises a failed drain
        record["drain_s"], record["steps_per_s_during_drain"] = drain_s, steps / max(drain_s, 1e-9)
        record["steps_per_s_without"] = (before + self._steps_per_s(step)) / 2  # before the save and after its drain

        record |= self._copied_and_restarted(rep, state, mesh, specs)

        alone_url = f"{self.base}/run-without-coordinator/step-{rep}"
        record["tiered_alone_save_s"] = self._timed(
            lambda: dcp.save(state, storage_writer=self._writer(alone_url, self.tiered), use_collectives=False)
        )
        ckptio.wait_for_uploads(DRAIN_TIMEOUT_S)  # its drain, and rank 0's merge of the fragments

        record["direct_async_blocking_s"] = self._async_blocking(state, self._writer(f"{direct_url}-async"))
        async_url = f"{self.base}/run/step-{2 * rep + 2}"
        # a tiered async save and its drain with nothing beside them: the CPU they cost this process
        # and the S3 server (when it runs on this machine)
        client, server = counting.cpu_seconds(), _processes_cpu_s(self.target.get("server_pids", []))
        record["tiered_async_blocking_s"] = self._async_blocking(state, self._writer(async_url, self.tiered))
        ckptio.wait_for_uploads(DRAIN_TIMEOUT_S)
        record["async_save_and_drain_cpu_s"] = counting.cpu_seconds() - client
        record["async_save_and_drain_server_cpu_s"] = _processes_cpu_s(self.target.get("server_pids", [])) - server

        latest, record["latest_s"] = _timed_value(lambda: ckptio.latest(f"{self.base}/run", **self._tier_options()))
        record["latest_is_newest"] = latest == async_url
        record |= self._load(url, "fast", mesh, specs, local_tier=self.node_tier)
        record |= self._load(url, "s3", mesh, specs, local_tier=None)
        record["payload_bytes"] = workload.held_tensor_bytes(state)
        self._remove_on_rank0(direct_url, self.options)
        self._remove_on_rank0(f"{direct_url}-async", self.options)
        self._remove_on_rank0(local_url, None)
        if rep:  # the previous repeat's steps: a long run must not fill the S3 server (radosgw's is 3 GiB)
            self._forget(f"{self.base}/run/step-{2 * rep - 1}", f"{self.base}/run/step-{2 * rep}")
        self._forget(alone_url)
        return record

    def _copied_and_restarted(self, rep: int, state: dict, mesh, specs) -> dict:
        """A tiered save copied to the other node (its blocking time, the bytes sent: (k-1) x this rank's
        files); then one whose drain is cut off, restarted (``latest`` and the load) with the last node's
        fast tier lost (an empty one in its place), again with every node's, and loaded from S3 alone. Nothing
        where the ranks are on one node (nothing to copy to)."""
        if self._nodes() < 2:
            return {}
        url = f"{self.base}/run-copies/step-{rep}"
        sent = replication.bytes_sent()["file"]
        record = {"copies_save_s": self._timed(lambda: dcp.save(state, storage_writer=self._writer(url, self.copied)))}
        ckptio.wait_for_uploads(DRAIN_TIMEOUT_S)
        record["copy_bytes_sent"] = replication.bytes_sent()["file"] - sent
        record["own_fast_tier_bytes"] = _own_bytes(local_step_path(self.node_tier, url, self.options), self.rank)

        lost_run = f"{self.base}/run-lost-{rep}"
        cut_off = dataclasses.replace(self.copied, drain_bandwidth=1, tuning=ckptio.Tuning(drain_timeout_s=0.5))
        dcp.save(state, storage_writer=self._writer(f"{lost_run}/step-1", cut_off))
        try:
            ckptio.wait_for_uploads(DRAIN_TIMEOUT_S)
        except ckptio.DrainError:
            pass  # as meant: nothing of it is on S3
        last_node = self._nodes() - 1
        lost = self.rank // self.cfg["mesh"][1] == last_node
        empty = os.path.join(self.cfg["tiered_fast_base"], f"replaced-{rep}")
        record |= self._restart(lost_run, "node_lost", mesh, specs, empty if lost else self.node_tier)
        ckptio.wait_for_uploads(DRAIN_TIMEOUT_S)  # the drain the restart resumed: committed on S3 now
        record |= self._restart(lost_run, "all_tiers", mesh, specs, self.node_tier)
        record |= self._load(f"{lost_run}/step-1", "s3_of_copied", mesh, specs, local_tier=None)
        self._forget(url, f"{lost_run}/step-1")
        self._remove_on_rank0(empty, None)
        return record

    def _nodes(self) -> int:
        return dist.get_world_size() // self.cfg["mesh"][1]

    def _restart(self, run: str, name: str, mesh, specs, tier: str) -> dict:
        loaded = workload.build_state(mesh, specs, self.cfg["data"], self.rank, empty=True)
        found: list = []

        def restart() -> None:
            start = counting.now()
            found.append(ckptio.latest(run, local_tier=tier, storage_options=self.options))
            found.append(counting.now() - start)
            reader = ckptio.Reader(found[0], storage_options=self.options, local_tier=tier)
            dcp.load(loaded, storage_reader=reader)
            found.append(reader.bytes_read)

        seconds = self._timed(restart)
        return {
            f"restart_{name}_s": seconds,
            f"restart_{name}_latest_s": found[1],
            f"restart_{name}_found": found[0] == f"{run}/step-1",
            f"restart_{name}_bytes_read": dict(found[2]),
            f"restart_{name}_mismatches": workload.check_state(loaded, specs, self.cfg["data"], self.rank),
        }

    def _forget(self, *urls: str) -> None:
        """Remove these tiered checkpoints from the durable tier and from every node's fast tier."""
        for url in urls:
            self._remove_on_rank0(url, self.options)
            for node in range(dist.get_world_size() // self.cfg["mesh"][1]):
                tier = os.path.join(self.cfg["tiered_fast_base"], f"node{node}")
                self._remove_on_rank0(local_step_path(tier, url, self.options), None)

    def memory_over_saves(self, state: dict, saves: int) -> dict:
        """This rank's RSS after each of ``saves`` tiered saves in a row, each drained before the next."""
        rss = []
        for k in range(saves):
            dcp.save(state, storage_writer=self._writer(f"{self.base}/memory/step-{k}", self.tiered))
            ckptio.wait_for_uploads(DRAIN_TIMEOUT_S)
            rss.append(counting.rss())
            if k:
                self._forget(f"{self.base}/memory/step-{k - 1}")
        return {
            "target": self.target["name"],
            "memory": True,
            "rank": self.rank,
            "rss_bytes": rss,
            "payload_bytes": workload.held_tensor_bytes(state),
        }

    def _tier_options(self) -> dict:
        return {"local_tier": self.node_tier, "storage_options": self.options}

    def _settle(self) -> None:
        """Wait (rank 0, then everyone) until the S3 server is idle: a server on this machine (radosgw
        after a burst of writes) would otherwise take the cores from the next measurement."""
        pids = self.target.get("server_pids", [])
        if self.rank == 0 and pids:
            end, last = counting.now() + SETTLE_MAX_S, _processes_cpu_s(pids)
            while counting.now() < end:
                time.sleep(SETTLE_WINDOW_S)
                now = _processes_cpu_s(pids)
                if now - last < SETTLE_WINDOW_S * IDLE_SHARE:
                    break
                last = now
        dist.barrier()

    def _steps_per_s(self, step: TrainingStep) -> float:
        self._settle()
        steps, seconds = step.run_for(BASELINE_S)
        return steps / seconds

    def _timed(self, fn) -> float:
        self._settle()
        return _timed_value(fn)[1]

    def _async_blocking(self, state: dict, writer: ckptio.Writer) -> float:
        self._settle()
        start = counting.now()
        future = dcp.async_save(state, storage_writer=writer)
        blocking = counting.now() - start
        getattr(future, "upload_completion", future).result()
        dist.barrier()
        return blocking

    def _load(self, url: str, tier: str, mesh, specs, local_tier: str | None) -> dict:
        loaded = workload.build_state(mesh, specs, self.cfg["data"], self.rank, empty=True)
        reader = ckptio.Reader(url, storage_options=self.options, local_tier=local_tier)
        seconds = self._timed(lambda: dcp.load(loaded, storage_reader=reader))
        return {
            f"load_{tier}_s": seconds,
            f"load_{tier}_bytes_read": dict(reader.bytes_read),
            f"load_{tier}_mismatches": workload.check_state(loaded, specs, self.cfg["data"], self.rank),
        }

    def emptied_tier_load(self, rep: int, mesh, specs) -> dict:
        """The last save of the runs loaded with the last rank's fast tier empty (a replaced node)."""
        last = dist.get_world_size() - 1
        tier = os.path.join(self.cfg["tiered_fast_base"], "emptied") if self.rank == last else self.node_tier
        loaded = workload.build_state(mesh, specs, self.cfg["data"], self.rank, empty=True)
        reader = ckptio.Reader(f"{self.base}/run/step-{2 * rep + 1}", storage_options=self.options, local_tier=tier)
        seconds = self._timed(lambda: dcp.load(loaded, storage_reader=reader))
        return {
            "target": self.target["name"],
            "emptied": True,
            "rank": self.rank,
            "tier_emptied": self.rank == last,
            "load_s": seconds,
            "bytes_read": dict(reader.bytes_read),
            "needed_bytes": workload.held_tensor_bytes(loaded),
            "mismatches": workload.check_state(loaded, specs, self.cfg["data"], self.rank),
        }

    def remove_all(self) -> None:
        if not self.cfg["keep"]:
            self._remove_on_rank0(self.base, self.options)

    @staticmethod
    def _remove_on_rank0(url: str, options: dict | None) -> None:
        dist.barrier()
        if dist.get_rank() == 0:
            try:
                counting.remove(url, options)
            except FileNotFoundError:
                pass
        dist.barrier()


def _own_bytes(folder: str, rank: int) -> int:
    """Bytes of this rank's fast-tier files (its data files and their indexes) in a step's folder."""
    own = f"-r{rank:05d}.ckio"
    return sum(e.stat().st_size for e in os.scandir(folder) if e.name.endswith((own, own + ".held.json")))


def _processes_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) of the processes ``pids`` so far; 0 for none (a remote server)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _timed_value(fn):
    dist.barrier()
    start = counting.now()
    value = fn()
    elapsed = counting.now() - start
    dist.barrier()
    return value, elapsed


#: The per-repeat times summarized: the slowest rank's, per repeat.
TIMES = (
    "direct_save_s",
    "local_save_s",
    "tiered_save_s",
    "tiered_alone_save_s",
    "drain_s",
    "direct_async_blocking_s",
    "tiered_async_blocking_s",
    "latest_s",
    "load_fast_s",
    "load_s3_s",
    "copies_save_s",
    "restart_node_lost_s",
    "restart_node_lost_latest_s",
    "restart_all_tiers_s",
    "restart_all_tiers_latest_s",
    "load_s3_of_copied_s",
)
#: (name, numerator, denominator): ratios per repeat of the slowest ranks' times, then their median.
RATIOS = (
    ("tiered_over_direct", "tiered_save_s", "direct_save_s"),
    ("tiered_over_local", "tiered_save_s", "local_save_s"),
    ("tiered_alone_over_tiered", "tiered_alone_save_s", "tiered_save_s"),
    ("async_tiered_over_direct", "tiered_async_blocking_s", "direct_async_blocking_s"),
    ("load_fast_over_s3", "load_fast_s", "load_s3_s"),
    ("copies_over_tiered", "copies_save_s", "tiered_save_s"),
    ("copies_over_direct", "copies_save_s", "direct_save_s"),
    ("node_lost_restart_over_s3", "restart_node_lost_s", "load_s3_of_copied_s"),
    ("all_tiers_restart_over_s3", "restart_all_tiers_s", "load_s3_of_copied_s"),
)


def summarize(records: list[dict]) -> list[dict]:
    """One row per target: medians and (min, max) over repeats of the slowest rank's times, ratios
    per repeat, training speed during the drains, memory growth, and the emptied-tier byte counts."""
    by_target: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_target[r["target"]].append(r)
    rows = []
    for target, recs in by_target.items():
        reps = defaultdict(list)
        for r in recs:
            if "repeat" in r:
                reps[r["repeat"]].append(r)
        ranks = [r for k in sorted(reps) for r in reps[k]]
        measured = [field for field in TIMES if all(field in r for r in ranks)]  # copies: with 2+ nodes
        slowest = {field: [max(r[field] for r in reps[k]) for k in sorted(reps)] for field in measured}
        row: dict = {"target": target, "repeats": len(reps)}
        for field, values in slowest.items():
            row[field] = stats(values)
        for name, top, bottom in RATIOS:
            if top in slowest and bottom in slowest:
                row[name] = stats([a / b for a, b in zip(slowest[top], slowest[bottom], strict=True)])
        row["training_speed_during_drain"] = stats(
            [
                statistics.mean(r["steps_per_s_during_drain"] / r["steps_per_s_without"] for r in reps[k])
                for k in sorted(reps)
            ]
        )
        row["commit_s"] = stats([next(r["drain_s"] for r in reps[k] if r["rank"] == 0) for k in sorted(reps)])
        row["save_and_drain_cpu_s"] = stats(
            [sum(r["async_save_and_drain_cpu_s"] for r in reps[k]) for k in sorted(reps)]
        )
        row["save_and_drain_server_cpu_s"] = stats(
            [max(r["async_save_and_drain_server_cpu_s"] for r in reps[k]) for k in sorted(reps)]
        )
        row |= _memory([r for r in recs if r.get("memory")])
        row["fast_load_durable_bytes"] = sum(r["load_fast_bytes_read"].get("durable", 0) for r in ranks)
        emptied = [r for r in recs if r.get("emptied")]
        lonely = next(r for r in emptied if r["tier_emptied"])
        row["emptied_s3_bytes"] = lonely["bytes_read"].get("durable", 0)
        row["emptied_needed_bytes"] = lonely["needed_bytes"]
        row["emptied_others_s3_bytes"] = sum(r["bytes_read"].get("durable", 0) for r in emptied if r is not lonely)
        if "copies_save_s" in row:
            row["copy_bytes_over_files"] = sum(r["copy_bytes_sent"] for r in ranks) / max(
                sum(r["own_fast_tier_bytes"] for r in ranks), 1
            )
            for restart in ("node_lost", "all_tiers"):
                read = [r[f"restart_{restart}_bytes_read"] for r in ranks]
                row[f"restart_{restart}_s3_bytes"] = sum(b["durable"] for b in read)
                row[f"restart_{restart}_peer_bytes"] = sum(b["peer"] for b in read)
        checked = ("mismatches", "load_fast_mismatches", "load_s3_mismatches", "load_s3_of_copied_mismatches")
        checked += ("restart_node_lost_mismatches", "restart_all_tiers_mismatches")
        row["bit_exact"] = all(not any(r.get(field) for field in checked) for r in recs)
        row["latest_agreed"] = all(
            r["latest_is_newest"] and r.get("restart_node_lost_found", True) and r.get("restart_all_tiers_found", True)
            for r in ranks
        )
        rows.append(row)
    return rows


def stats(values: list[float]) -> dict:
    """Median, min and max of per-repeat figures (the incremental section's too)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _memory(recs: list[dict]) -> dict:
    """Largest per-rank RSS growth from after the first of the saves in a row to after the last."""
    growth = max(r["rss_bytes"][-1] - r["rss_bytes"][0] for r in recs)
    payload = max(r["payload_bytes"] for r in recs)
    return {
        "rss_bytes_after_each_save": [max(r["rss_bytes"][k] for r in recs) for k in range(len(recs[0]["rss_bytes"]))],
        "rss_growth_bytes": growth,
        "rss_growth_saves": len(recs[0]["rss_bytes"]),
        "payload_bytes": payload,
        "rss_growth_over_payload": growth / payload if payload else None,
    }
