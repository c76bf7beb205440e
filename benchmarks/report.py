"""Turn per-rank records into per-writer figures, and figures into a table, Markdown, JSON and charts."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from typing import Any

from . import counting

SCHEMA_VERSION = 1


def on_s3(row: dict) -> bool:
    """Whether a result row is of an S3 target, whose requests are counted (botocore's event hooks; GCS and
    Azure requests are not: their rows show none). Rows of older runs: by the target's name."""
    return row.get("target_kind", "local" if row["target"] == "local" else "s3") == "s3"


def summarize(records: list[dict], files: dict[str, dict[str, int]], world: int, sizes: dict[str, int]) -> list[dict]:
    """One row per (target, writer). ``files`` maps a repeat-0 URL to its listing."""
    grouped: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        grouped[(r["target"], r["writer"])].append(r)
    rows = []
    for (target, writer), recs in grouped.items():
        reps = sorted({r["repeat"] for r in recs})
        save = [max(r["save_s"] for r in recs if r["repeat"] == k) for k in reps]
        load = [max(r["load_s"] for r in recs if r["repeat"] == k) for k in reps]
        gib = sizes["unique_bytes"] / (1 << 30)
        # CPU seconds of all ranks (every thread: the S3 client's too) per GiB of the state's unique bytes
        save_cpu = [sum(r.get("save_cpu_s", math.nan) for r in recs if r["repeat"] == k) / gib for k in reps]
        load_cpu = [sum(r.get("load_cpu_s", math.nan) for r in recs if r["repeat"] == k) / gib for k in reps]
        first = [r for r in recs if r["repeat"] == 0]
        listing = files[first[0]["url"]]
        per_rank = [0] * world
        for name, size in listing.items():
            rank = counting.rank_of(name)
            if rank is not None and rank < world:
                per_rank[rank] += size
        written = sum(listing.values())
        row = {
            "target": target,
            "target_kind": recs[0].get("target_kind", "local" if target == "local" else "s3"),
            "writer": writer,
            "save_s_median": statistics.median(save),
            "save_s_min": min(save),
            "save_s_max": max(save),
            "load_s_median": statistics.median(load),
            "load_s_min": min(load),
            "load_s_max": max(load),
            "reshard_load_s": max(r["reshard_load_s"] for r in first),
            "save_cpu_s_per_gib_median": statistics.median(save_cpu),
            "save_cpu_s_per_gib_min": min(save_cpu),
            "save_cpu_s_per_gib_max": max(save_cpu),
            "load_cpu_s_per_gib_median": statistics.median(load_cpu),
            "load_cpu_s_per_gib_min": min(load_cpu),
            "load_cpu_s_per_gib_max": max(load_cpu),
            "save_MBps": sizes["unique_bytes"] / statistics.median(save) / 1e6,
            "logical_bytes": sizes["logical_bytes"],
            "unique_bytes": sizes["unique_bytes"],
            "bytes_written": written,
            "bytes_loaded": sum(r.get("loaded_bytes", 0) for r in first),
            "dedup_ratio": sizes["logical_bytes"] / written,
            "write_amplification": written / sizes["unique_bytes"],
            "objects": len(listing),
            "empty_objects": sum(1 for size in listing.values() if size == 0),
            "writing_ranks": sum(1 for b in per_rank if b),
            "largest_rank_bytes": max(per_rank),
            "mean_rank_bytes": sum(per_rank) / world,
            "peak_rss_save_bytes": max(r["save_rss_bytes"] for r in recs),
            "peak_rss_load_bytes": max(r["load_rss_bytes"] for r in recs),
            "save_requests": _sum_counts(r["save_requests"] for r in first),
            "load_requests": _sum_counts(r["load_requests"] for r in first),
            "reshard_load_requests": _sum_counts(r["reshard_load_requests"] for r in first),
            "load_bit_exact": all(not r["load_mismatches"] for r in recs),
            "reshard_bit_exact": all(not r["reshard_mismatches"] for r in first),
            "bytes_by_dtype": next((r["bytes_by_dtype"] for r in first if "bytes_by_dtype" in r), {}),
            "phases": {kind: _phases(recs, reps, f"{kind}_phases") for kind in ("save", "load")},
        }
        rows.append(row)
    return rows


def _phases(recs: list[dict], reps: list[int], field: str) -> dict[str, list[float]]:
    """phase -> [median, min, max] over repeats of the slowest rank's seconds in it."""
    names = list(next((r[field] for r in recs if field in r), {}))
    out = {}
    for name in names:
        slowest = [max(r[field][name] for r in recs if r["repeat"] == k) for k in reps]
        out[name] = [statistics.median(slowest), min(slowest), max(slowest)]
    return out


def raw_bandwidth(records: list[dict]) -> dict[str, dict]:
    """target -> the raw parallel write+fsync and read of ``phases.raw_bandwidth`` (MB/s, the median
    over repeats, and its min and max)."""
    by_target: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r["rank"] == 0:  # every rank holds the slowest rank's figures
            by_target[r["target"]].append(r["raw_bandwidth"])
    out = {}
    for target, runs in by_target.items():
        out[target] = {"bytes": runs[0]["bytes"]}
        for kind in ("write", "read", "cached_read"):
            mbps = sorted(raw["bytes"] / raw[f"{kind}_s"] / 1e6 for raw in runs if f"{kind}_s" in raw)
            if mbps:
                out[target][f"{kind}_MBps"] = statistics.median(mbps)
                out[target][f"{kind}_MBps_range"] = [mbps[0], mbps[-1]]
    return out


def _spread(values: list[float]) -> str:
    return f"{values[0]:.3f} ({values[1]:.3f}-{values[2]:.3f})"


def phase_table(rows: list[dict], raw: dict[str, dict], markdown: bool = False) -> str:
    """Per-phase seconds of each writer (slowest rank, median and min-max over repeats), the write and
    read phases' bandwidth, and the shares of the target's raw write+fsync and checked cached read
    bandwidth they reach."""
    header = [
        "target",
        "writer",
        "save: plan",
        "write",
        "finish",
        "write MB/s",
        "of raw",
        "load: metadata",
        "plan",
        "read",
        "read MB/s",
        "of cached",
    ]
    lines = []
    for r in rows:
        save, load = r.get("phases", {}).get("save"), r.get("phases", {}).get("load")
        if not save or not load:
            continue
        write_mbps = r["bytes_written"] / save["write"][0] / 1e6 if save["write"][0] else math.nan
        read_mbps = r.get("bytes_loaded", 0) / load["read"][0] / 1e6 if load["read"][0] else math.nan
        target_raw = raw.get(r["target"], {})
        lines.append(
            [r["target"], r["writer"], _spread(save["plan"]), _spread(save["write"]), _spread(save["finish"])]
            + [f"{write_mbps:.0f}", _share(write_mbps, target_raw.get("write_MBps"))]
            + [_spread(load["metadata"]), _spread(load["plan"]), _spread(load["read"])]
            + [f"{read_mbps:.0f}", _share(read_mbps, target_raw.get("cached_read_MBps"))]
        )
    return _grid(header, lines, markdown) if lines else ""


def _share(mbps: float, raw_mbps: float | None) -> str:
    return f"{mbps / raw_mbps:.2f}" if raw_mbps and mbps == mbps and mbps > 0 else "-"


def report_raw(doc: dict[str, Any], cfg: dict[str, Any]) -> str:
    return raw_lines(doc.get("raw_bandwidth", {}), cfg["ranks"]).replace("\n", "; ") or "not measured"


def raw_lines(raw: dict[str, dict], world: int) -> str:
    return "\n".join(
        f"{target}: write+fsync {r['write_MBps']:.0f} MB/s ({r['write_MBps_range'][0]:.0f}-"
        f"{r['write_MBps_range'][1]:.0f}), read {r['read_MBps']:.0f} MB/s ({r['read_MBps_range'][0]:.0f}-"
        f"{r['read_MBps_range'][1]:.0f}) with the page cache dropped"
        + (
            f", checked read from the cache {r['cached_read_MBps']:.0f} MB/s ({r['cached_read_MBps_range'][0]:.0f}-"
            f"{r['cached_read_MBps_range'][1]:.0f})"
            if "cached_read_MBps" in r
            else ""
        )
        + f" ({world} processes, {_mib(r['bytes'] / world)} MiB each in 8 MiB system calls)"
        for target, r in raw.items()
    )


def dtype_table(rows: list[dict]) -> str:
    """Stored / logical bytes per dtype for every writer (how much compression saves on what)."""
    dtypes = sorted({d for r in rows for d in r.get("bytes_by_dtype", {})})
    if not dtypes:
        return ""
    header = ["target", "writer"] + [f"{d} saved" for d in dtypes] + ["all saved"]
    lines = ["  ".join(header)]
    for r in rows:
        by = r.get("bytes_by_dtype", {})
        cells = [f"{1 - by[d][1] / by[d][0]:.1%}" if d in by and by[d][0] else "-" for d in dtypes]
        logical, stored = sum(v[0] for v in by.values()), sum(v[1] for v in by.values())
        lines.append("  ".join([r["target"], r["writer"], *cells, f"{1 - stored / logical:.1%}" if logical else "-"]))
    return "\n".join(lines)


def shared_reads(records: list[dict], files: dict[str, dict[str, int]]) -> list[dict]:
    """``--shared-reads``: per (target, writer, load mesh, dedup_reads), the load time (slowest
    rank, median over repeats with min-max), bytes served / bytes stored, and GETs (all ranks)."""
    grouped: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    stored: dict[tuple, int] = {}
    for r in records:
        for load in r.get("shared_reads", []):
            key = (r["target"], r["writer"], load["mesh"], load["dedup_reads"])
            grouped[key][r["repeat"]].append(load)
            if r["url"] in files:
                stored[key[:2]] = sum(n for name, n in files[r["url"]].items() if counting.rank_of(name) is not None)
    rows = []
    for key, by_repeat in grouped.items():
        times = [max(x["load_s"] for x in loads) for loads in by_repeat.values()]
        first = by_repeat[min(by_repeat)]
        served = sum(x["served_bytes"] for x in first)
        rows.append(
            {
                "target": key[0],
                "writer": key[1],
                "load_mesh": key[2],
                "dedup_reads": key[3],
                "load_s_median": statistics.median(times),
                "load_s_min": min(times),
                "load_s_max": max(times),
                "served_bytes": served,
                "served_over_stored": served / stored[key[:2]] if stored.get(key[:2]) else None,
                "gets": sum(x["gets"] for x in first),
                "bit_exact": all(x["bit_exact"] for loads in by_repeat.values() for x in loads),
            }
        )
    return rows


def shared_reads_table(rows: list[dict], markdown: bool = False) -> str:
    if not rows:
        return ""
    header = ["target", "writer", "load mesh", "dedup_reads", "load s (min-max)", "served/stored", "GETs", "exact"]
    cells = [
        [
            r["target"],
            r["writer"],
            r["load_mesh"],
            r["dedup_reads"],
            f"{r['load_s_median']:.2f} ({r['load_s_min']:.2f}-{r['load_s_max']:.2f})",
            "-" if r["target"] == "local" or r["served_over_stored"] is None else f"{r['served_over_stored']:.2f}",
            "-" if r["target"] == "local" else str(r["gets"]),
            "yes" if r["bit_exact"] else "NO",
        ]
        for r in rows
    ]
    return _grid(header, cells, markdown)


def async_table(rows: list[dict], markdown: bool = False) -> str:
    """``--async-saves``: blocking time against a synchronous save, training speed during the
    background write against before, and host memory growth (process tree PSS) against the payload."""
    if not rows:
        return ""
    header = [
        "writer + stager",
        "executor",
        "sync s",
        "blocking ms (min-max)",
        "blocking/sync",
        "background s",
        "steps/s before -> during",
        f"memory growth MiB (x payload), save 2 -> {rows[0]['saves']}",
        "exact",
    ]
    cells = [
        [
            r["setup"],
            r["executor"],
            f"{r['sync_s_median']:.3f}",
            f"{r['blocking_s_median'] * 1e3:.1f} ({r['blocking_s_min'] * 1e3:.0f}-{r['blocking_s_max'] * 1e3:.0f})",
            f"{r['blocking_over_sync']:.2f}",
            f"{r['background_s_median']:.2f}",
            f"{r['steps_per_s_before']:.0f} -> {r['steps_per_s_during']:.0f} ({r['training_speed_during']:.2f})",
            f"{r['tree_pss_growth_bytes'] / (1 << 20):+.0f} ({r['tree_pss_growth_over_payload']:+.2f})",
            "yes" if r["bit_exact"] else "NO",
        ]
        for r in rows
    ]
    return _grid(header, cells, markdown)


def tiered_table(rows: list[dict], markdown: bool = False) -> str:
    """``--tiered``: one column per S3 target; times are the slowest rank's, median (min-max) over
    repeats, ratios per repeat."""
    if not rows:
        return ""

    def seconds(row: dict, field: str) -> str:
        v = row[field]
        return f"{v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})"

    def ratio(row: dict, field: str) -> str:
        v = row[field]
        return f"{v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})"

    copied = [
        ("tiered save copied to the other node (blocking), s", lambda r: seconds(r, "copies_save_s")),
        ("  copied / not copied", lambda r: ratio(r, "copies_over_tiered")),
        ("  copied / direct S3", lambda r: ratio(r, "copies_over_direct")),
        ("  bytes sent / the ranks' fast-tier files", lambda r: f"{r['copy_bytes_over_files']:.3f}x"),
        ("restart, last node lost, drain cut off (latest + load), s", lambda r: seconds(r, "restart_node_lost_s")),
        ("  of which ckptio.latest, s", lambda r: seconds(r, "restart_node_lost_latest_s")),
        (
            "  S3 / peer bytes it read",
            lambda r: f"{r['restart_node_lost_s3_bytes']} / {r['restart_node_lost_peer_bytes']} B",
        ),
        ("restart, every node's fast tier (latest + load), s", lambda r: seconds(r, "restart_all_tiers_s")),
        ("  of which ckptio.latest, s", lambda r: seconds(r, "restart_all_tiers_latest_s")),
        ("  S3 bytes it read", lambda r: f"{r['restart_all_tiers_s3_bytes']} B"),
        ("load of the same step from S3, s", lambda r: seconds(r, "load_s3_of_copied_s")),
        ("  node lost / S3 load", lambda r: ratio(r, "node_lost_restart_over_s3")),
        ("  every node / S3 load", lambda r: ratio(r, "all_tiers_restart_over_s3")),
    ]
    lines = [
        ("direct S3 save, s", lambda r: seconds(r, "direct_save_s")),
        ("local-only save (fast tier's disk), s", lambda r: seconds(r, "local_save_s")),
        ("tiered save (blocking), s", lambda r: seconds(r, "tiered_save_s")),
        ("  tiered / direct S3", lambda r: ratio(r, "tiered_over_direct")),
        ("  tiered / local-only", lambda r: ratio(r, "tiered_over_local")),
        ("tiered save without a coordinator (blocking), s", lambda r: seconds(r, "tiered_alone_save_s")),
        ("  without / with a coordinator", lambda r: ratio(r, "tiered_alone_over_tiered")),
        ("drain until committed on S3, s", lambda r: seconds(r, "commit_s")),
        ("drain, slowest rank (its wait for the commit), s", lambda r: seconds(r, "drain_s")),
        (
            "CPU of a tiered async save + drain: ranks / S3 server, s",
            lambda r: (
                f"{r['save_and_drain_cpu_s']['median']:.2f} / "
                + (
                    f"{r['save_and_drain_server_cpu_s']['median']:.2f}"
                    if r["save_and_drain_server_cpu_s"]["median"]
                    else "remote"
                )
            ),
        ),
        ("training speed during the drain / without", lambda r: ratio(r, "training_speed_during_drain")),
        ("dcp.async_save blocking, direct S3, s", lambda r: seconds(r, "direct_async_blocking_s")),
        ("dcp.async_save blocking, tiered, s", lambda r: seconds(r, "tiered_async_blocking_s")),
        ("ckptio.latest, s", lambda r: seconds(r, "latest_s")),
        ("restart load from the fast tier, s", lambda r: seconds(r, "load_fast_s")),
        ("load of the same checkpoint from S3, s", lambda r: seconds(r, "load_s3_s")),
        ("  fast tier / S3", lambda r: ratio(r, "load_fast_over_s3")),
        *(copied if all("copies_save_s" in r for r in rows) else []),  # 2+ nodes: copies, a node lost
        (
            "one rank's tier emptied: S3 bytes / its need",
            lambda r: (
                f"{r['emptied_s3_bytes'] / max(r['emptied_needed_bytes'], 1):.4f}x "
                f"(others: {r['emptied_others_s3_bytes']} B)"
            ),
        ),
        (
            f"RSS growth over {rows[0]['rss_growth_saves']} tiered saves in a row",
            lambda r: f"{r['rss_growth_bytes'] / (1 << 20):+.0f} MiB ({r['rss_growth_over_payload']:+.2f}x payload)",
        ),
        (
            "bit-exact, latest agreed",
            lambda r: f"{'yes' if r['bit_exact'] else 'NO'}, {'yes' if r['latest_agreed'] else 'NO'}",
        ),
    ]
    header = ["", *(f"{r['target']} ({r['repeats']} repeats)" for r in rows)]
    return _grid(header, [[name, *(fn(r) for r in rows)] for name, fn in lines], markdown)


def incremental_table(rows: list[dict], markdown: bool = False) -> str:
    """``--incremental``: one column per (state, target); the slowest rank's times, median (min-max) over
    repeats, ratios per repeat (incremental over full save of the same state)."""
    if not rows:
        return ""

    def stat(row: dict, field: str, unit: str = "x", digits: int = 2) -> str:
        v = row[field]
        return f"{v['median']:.{digits}f}{unit} ({v['min']:.{digits}f}-{v['max']:.{digits}f})"

    def written(row: dict, which: str) -> str:
        w = row[f"{which}_written"]
        return f"{_mib(w['bytes'])} MiB in {w['objects']} objects"

    lines = [
        ("changed between the saves (logical)", lambda r: f"{_mib(r['changed_bytes'])} MiB"),
        ("full save writes", lambda r: written(r, "full")),
        ("incremental save writes", lambda r: written(r, "incremental")),
        ("  its data files / changed bytes", lambda r: f"{r['data_over_changed']:.3f}x"),
        ("  bytes written / full save's", lambda r: stat(r, "written_bytes", digits=3)),
        ("full save, s", lambda r: stat(r, "full_save_s", " s", 3)),
        ("incremental save, s", lambda r: stat(r, "incremental_save_s", " s", 3)),
        ("  incremental / full save time", lambda r: stat(r, "save_time")),
        ("  incremental / full save CPU (all ranks)", lambda r: stat(r, "save_cpu")),
        ("load, depth 1 / full", lambda r: stat(r, "load_time_depth_1")),
        (
            "load at the depth bound / full",
            lambda r: f"{stat(r, 'load_time_at_bound')} at depth {r['deep_depth']}",
        ),
        ("resharded load (Wx1), depth 1 / full (repeat 0)", lambda r: f"{r.get('reshard_load_time', 0):.2f}x"),
        (
            f"RSS growth over {rows[0]['rss_growth_saves']} incremental saves in a row",
            lambda r: f"{r['rss_growth_bytes'] / (1 << 20):+.0f} MiB",
        ),
        ("bit-exact", lambda r: "yes" if r["bit_exact"] else "NO"),
    ]
    header = ["", *(f"{r['state']}, {r['target']} ({r['repeats']} repeats)" for r in rows)]
    return _grid(header, [[name, *(fn(r) for r in rows)] for name, fn in lines], markdown)


def plan_table(rows: list[dict], markdown: bool = False) -> str:
    """``--plan-tensors``: plan time (dcp.save until write_data) of save 1 and of the later saves."""
    if not rows:
        return ""
    header = ["writer", "tensors", "plan s, save 1", "plan s, saves 2+ (min-max)", "save s, save 1", "save s, saves 2+"]
    cells = [
        [
            r["writer"],
            str(r["tensors"]),
            f"{r['first_plan_s']:.3f}",
            f"{r['later_plan_s_median']:.3f} ({r['later_plan_s_min']:.3f}-{r['later_plan_s_max']:.3f})",
            f"{r['first_save_s']:.3f}",
            f"{r['later_save_s_median']:.3f}",
        ]
        for r in rows
    ]
    return _grid(header, cells, markdown)


def scale_table(rows: list[dict], markdown: bool = False) -> str:
    """``--scale``: the coordinator's seconds and the metadata bytes, per layout, size and writer;
    "us/item" divides the three phases by the items of all local plans (flat when growth is linear).
    Rows without a coordinator: global plan and finish are the slowest rank's own, decode is the merge
    of the fragments on load (where rank 0's merged ckptio.json is missing), "merged" a load's decode of
    it, and the memory is one rank's (traced) instead of the coordinator's."""
    if not rows:
        return ""
    header = [
        "layout",
        "ranks x layers",
        "items",
        "writer",
        "global plan s",
        "finish s",
        "decode s (min-max)",
        "merged: decode s (min-max)",
        "us/item",
        "metadata MiB",
        "B/item",
        "read per load MiB",
        "plans gathered MiB",
        "peak RSS GiB",
        "one rank's peak MiB",
    ]
    cells = []
    for r in rows:
        total = r["global_plan_s"] + r["finish_s"] + r["decode_s"]
        cells.append(
            [
                r["layout"],
                f"{r['ranks']} x {r['layers']}",
                str(r["items"]),
                r["writer"],
                f"{r['global_plan_s']:.2f}",
                f"{r['finish_s']:.2f}",
                f"{r['decode_s']:.2f} ({r['decode_min_s']:.2f}-{r['decode_max_s']:.2f})",
                f"{r['merged_decode_s']:.2f} ({r['merged_decode_min_s']:.2f}-{r['merged_decode_max_s']:.2f})"
                if "merged_decode_s" in r
                else "-",
                f"{total / r['items'] * 1e6:.1f}",
                _mib(r["metadata_bytes"]),
                f"{r['metadata_bytes'] / r['items']:.0f}",
                _mib(r.get("metadata_read_bytes", r["metadata_bytes"])),
                _mib(r["gathered_plan_bytes"]),
                f"{r['peak_rss_bytes'] / (1 << 30):.2f}" if "rank_peak_bytes" not in r else "-",
                _mib(r["rank_peak_bytes"]) if "rank_peak_bytes" in r else "-",
            ]
        )
    return _grid(header, cells, markdown)


def _sum_counts(counts) -> dict[str, int]:
    total: dict[str, int] = defaultdict(int)
    for c in counts:
        for k, v in c.items():
            total[k] += v
    return {k: total.get(k, 0) for k in (*counting.REQUEST_KINDS, counting.THROTTLED)}


def total_requests(counts: dict[str, int]) -> int:
    """Requests sent (a throttled answer is one of them, not one more)."""
    return sum(counts.get(k, 0) for k in counting.REQUEST_KINDS)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f}"


COLUMNS = [
    ("target", lambda r: r["target"]),
    ("writer", lambda r: r["writer"]),
    ("save s", lambda r: f"{r['save_s_median']:.2f}"),
    ("load s", lambda r: f"{r['load_s_median']:.2f}"),
    ("MB/s", lambda r: f"{r['save_MBps']:.0f}"),
    (
        "save/load CPU s/GiB",
        lambda r: (
            f"{r.get('save_cpu_s_per_gib_median', math.nan):.2f}/{r.get('load_cpu_s_per_gib_median', math.nan):.2f}"
        ),
    ),
    ("written MiB", lambda r: _mib(r["bytes_written"])),
    ("dedup", lambda r: f"{r['dedup_ratio']:.2f}"),
    ("write amp", lambda r: f"{r['write_amplification']:.3f}"),
    ("objects (empty)", lambda r: f"{r['objects']} ({r['empty_objects']})"),
    ("max/mean rank MiB", lambda r: f"{_mib(r['largest_rank_bytes'])}/{_mib(r['mean_rank_bytes'])}"),
    ("save req", lambda r: str(total_requests(r["save_requests"])) if on_s3(r) else "-"),
    ("load req", lambda r: str(total_requests(r["load_requests"])) if on_s3(r) else "-"),
    ("peak RSS MiB", lambda r: _mib(r["peak_rss_save_bytes"])),
    ("bit-exact", lambda r: "yes" if r["load_bit_exact"] and r["reshard_bit_exact"] else "NO"),
]


def table(rows: list[dict], markdown: bool = False) -> str:
    return _grid([name for name, _ in COLUMNS], [[fn(r) for _, fn in COLUMNS] for r in rows], markdown)


def _grid(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    """A Markdown table, or plain aligned columns."""
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(out + ["| " + " | ".join(row) + " |" for row in rows])
    cells = [header, *rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def request_table(rows: list[dict], markdown: bool = False) -> str:
    kinds = [k for k in counting.REQUEST_KINDS if any(r["save_requests"][k] or r["load_requests"][k] for r in rows)]
    s3_rows = [r for r in rows if on_s3(r)]
    if not s3_rows or not kinds:
        return ""
    cells = []
    for r in s3_rows:
        for phase in ("save", "load"):
            counts = r[f"{phase}_requests"]
            cells.append(
                [
                    r["target"],
                    r["writer"],
                    phase,
                    *[str(counts[k]) for k in kinds],
                    str(total_requests(counts)),
                    str(counts.get(counting.THROTTLED, 0)),
                ]
            )
    return _grid(["target", "writer", "phase", *kinds, "total", "throttled (503/429)"], cells, markdown)


def compare(rows: list[dict], old_path: str) -> str:
    with open(old_path) as f:
        old = {(r["target"], r["writer"]): r for r in json.load(f)["results"]}
    lines = ["target  writer  save s (delta)  load s (delta)  written MiB (delta)  save req (delta)"]
    for r in rows:
        o = old.get((r["target"], r["writer"]))
        if o is None:
            lines.append(f"{r['target']}  {r['writer']}  (new)")
            continue
        lines.append(
            f"{r['target']}  {r['writer']}  {r['save_s_median']:.2f} ({_pct(r['save_s_median'], o['save_s_median'])})"
            f"  {r['load_s_median']:.2f} ({_pct(r['load_s_median'], o['load_s_median'])})"
            f"  {_mib(r['bytes_written'])} ({_pct(r['bytes_written'], o['bytes_written'])})"
            f"  {total_requests(r['save_requests'])}"
            f" ({_pct(total_requests(r['save_requests']), total_requests(o['save_requests']))})"
        )
    return "\n".join(lines)


def _pct(new: float, old: float) -> str:
    return f"{(new - old) / old * 100:+.1f}%" if old else "n/a"


def markdown_report(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    parts = [
        "# ckptio benchmark",
        f"{cfg['ranks']} ranks, mesh {cfg['mesh'][0]}x{cfg['mesh'][1]} (replicate x shard), "
        f"{_mib(cfg['size_bytes'])} MiB state ({cfg.get('data', 'bf16-in-fp32' if cfg['compressible'] else 'randn')}), "
        f"{cfg['repeats']} repeat(s); torch {doc['versions']['torch']}, ckptio {doc['versions']['ckptio']}, "
        f"{doc['machine']['cpus']} CPUs.",
        "",
        table(doc["results"], markdown=True),
    ]
    phases = phase_table(doc["results"], doc.get("raw_bandwidth", {}), markdown=True)
    if phases:
        parts += [
            "",
            "## Phases",
            "",
            "Seconds in each writer's methods on the slowest rank, median (min-max) over repeats; a rank's wait "
            "for the others between methods is in no phase. The target's own bandwidth, for comparison: "
            + report_raw(doc, cfg),
            "",
            phases,
        ]
    requests = request_table(doc["results"], markdown=True)
    if requests:
        parts += ["", "## S3 requests (client side, all ranks)", "", requests]
    by_dtype = dtype_table(doc["results"])
    if by_dtype and any("zstd" in r["writer"] for r in doc["results"]):
        parts += ["", "## Bytes saved by compression, per dtype", "", "```", by_dtype, "```"]
    shared = shared_reads_table(doc.get("shared_reads", []), markdown=True)
    if shared:
        parts += ["", "## Shared reads (loads of the saved checkpoint on other meshes)", "", shared]
    asynchronous = async_table(doc.get("async_saves", []), markdown=True)
    if asynchronous:
        parts += [
            "",
            "## Asynchronous saves (a training-step loop beside each background save)",
            "",
            "Blocking: time in dcp.async_save, slowest rank, saves 2..N. Memory: PSS of each rank's process "
            "tree (torch's PROCESS executor included), largest growth over the ranks.",
            "",
            asynchronous,
        ]
    from .lagging import table as lagging_table  # the report's tables are its own; this one lives with its run

    lagging = lagging_table(doc.get("tiered_lagging", []))
    if lagging:
        parts += [
            "",
            "## Tiered incremental saves faster than the drain",
            "",
            "A LoRA-shaped state saved about every second, the drain limited to half the rate full saves would "
            "need, and unlimited; bytes per save from the S3 listings, median (min-max) over repeats.",
            "",
            lagging,
        ]
    tiers = tiered_table(doc.get("tiered", []), markdown=True)
    if tiers:
        parts += [
            "",
            "## Tiered saves (a node-local fast tier drained to S3 in the background)",
            "",
            "Slowest rank per repeat, median (min-max); ratios per repeat. Nodes are simulated: one replica group "
            "each, sharing a fast-tier directory on the local disk. Training speed: steps/s of a training-step loop "
            "while the drain runs against the same loop with no save. Memory: largest per-rank RSS growth.",
            "",
            tiers,
        ]
    incremental = incremental_table(doc.get("incremental", []), markdown=True)
    if incremental:
        parts += [
            "",
            "## Incremental saves (WriterConfig.incremental_from) beside full saves of the same state",
            "",
            "Slowest rank per repeat, median (min-max); ratios per repeat. Bytes and objects from the listings "
            "(an incremental save's marker in its base's folder included).",
            "",
            incremental,
        ]
    plans = plan_table(doc.get("plan_time", []), markdown=True)
    if plans:
        parts += ["", "## Plan time (torch's plan cache on)", "", plans]
    scaled = scale_table(doc.get("scale", []), markdown=True)
    if scaled:
        parts += ["", "## Coordinator and metadata at scale (simulated plans, one process)", "", scaled]
    for chart in ("charts", "async_charts"):
        if doc.get(chart):
            parts += ["", f"![{chart}]({doc[chart]})"]
    return "\n".join(parts) + "\n"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _grouped_bars(ax, title: str, categories: list[str], series: list[str], height, tick_labels, rotation: int) -> None:
    """One bar per (category, series) side by side; ``height(series, category)`` is None where a
    series has no value (a series with none at all is left out)."""
    width = 0.8 / max(len(series), 1)
    for i, name in enumerate(series):
        heights = [height(name, c) for c in categories]
        if all(h is None for h in heights):
            continue
        xs = [k + i * width for k in range(len(categories))]
        ax.bar(xs, [h or 0 for h in heights], width, label=name, color=f"C{i}")
    ax.set_title(title)
    ax.set_xticks([k + width * (len(series) - 1) / 2 for k in range(len(categories))])
    ax.set_xticklabels(tick_labels, fontsize=7, rotation=rotation, ha="right")
    ax.legend(fontsize=7)


def _save(plt, fig, path: str) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def async_charts(rows: list[dict], path: str) -> bool:
    """Three panels for ``--async-saves``: blocking/sync, training speed during/before, memory growth/payload."""
    plt = _pyplot()
    if plt is None or not rows:
        return False
    panels = [
        ("blocking time / synchronous save", "blocking_over_sync"),
        ("training steps/s during save / before", "training_speed_during"),
        (f"memory growth save 2 -> {rows[0]['saves']} / payload", "tree_pss_growth_over_payload"),
    ]
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    executors = list(dict.fromkeys(r["executor"] for r in rows))
    by = {(r["executor"], r["setup"]): r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, (title, key) in zip(axes, panels, strict=True):
        labels = [s.replace(" + ", "\n+ ") for s in setups]
        _grouped_bars(
            ax, title, setups, executors, lambda e, s, key=key: (by.get((e, s)) or {}).get(key) or 0, labels, 20
        )
        ax.axhline(0, color="black", linewidth=0.5)
    return _save(plt, fig, path)


def charts(rows: list[dict], path: str) -> bool:
    plt = _pyplot()
    if plt is None:
        return False
    panels = [
        ("save time (s)", lambda r: r["save_s_median"]),
        ("load time (s)", lambda r: r["load_s_median"]),
        ("bytes written (MiB)", lambda r: r["bytes_written"] / (1 << 20)),
        ("objects / files", lambda r: r["objects"]),
        ("S3 save requests", lambda r: total_requests(r["save_requests"])),
        ("S3 load requests", lambda r: total_requests(r["load_requests"])),
    ]
    targets = sorted({r["target"] for r in rows})
    writers = list(dict.fromkeys(r["writer"] for r in rows))
    by = {(r["target"], r["writer"]): r for r in rows}
    labels = [w.replace("torch ", "torch\n").replace("ckptio ", "ckptio\n") for w in writers]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    for ax, (title, value) in zip(axes.flat, panels, strict=True):

        def height(target: str, writer: str, title=title, value=value):
            if title.startswith("S3") and not any(on_s3(r) for (t, _), r in by.items() if t == target):
                return None
            return value(by[(target, writer)]) if (target, writer) in by else 0

        _grouped_bars(ax, title, writers, targets, height, labels, 30)
    return _save(plt, fig, path)
