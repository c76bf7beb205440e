"""The benchmark's counting, its CLI on the embedded default, and its JSON schema."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from ckptio.bench import counting, report, workload
from ckptio.bench.__main__ import main as bench_main

import ckptio
from ckptio.config import REMOTE_READ_GAP_BYTES
from tests.conftest import S3_SERVERS
from tests.helpers.faultproxy import Fault
from tests.helpers.metadata_view import readable_metadata


def test_summary_figures_from_a_hand_computed_run():
    # 2 ranks, repeat 0 and 1; 1000 unique bytes held twice (logical 2000) written as 600 + 400 + 20 metadata
    listing = {
        "data-0123456789abcdef-r00000.ckio": 600,
        "data-0123456789abcdef-r00001.ckio": 400,
        "ckptio.json": 20,
        "__1_0.distcp": 0,
    }
    base = {
        "target": "local",
        "writer": "w",
        "url": "u",
        "load_mismatches": [],
        "reshard_mismatches": [],
        "save_requests": {"PUT": 1},
        "load_requests": {"GET": 2},
        "reshard_load_requests": {},
        "save_rss_bytes": 10,
        "load_rss_bytes": 5,
        "reshard_load_s": 0.5,
    }
    records = [dict(base, rank=r, repeat=k, save_s=1.0 + k + r, load_s=2.0 + k) for r in (0, 1) for k in (0, 1)]
    (row,) = report.summarize(records, {"u": listing}, world=2, sizes={"logical_bytes": 2000, "unique_bytes": 1000})
    assert row["save_s_median"] == 2.5 and row["save_s_min"] == 2.0 and row["save_s_max"] == 3.0  # max over ranks
    assert row["bytes_written"] == 1020 and row["dedup_ratio"] == 2000 / 1020
    assert row["write_amplification"] == 1.02
    assert row["objects"] == 4 and row["empty_objects"] == 1
    assert row["largest_rank_bytes"] == 600 and row["mean_rank_bytes"] == 500 and row["writing_ranks"] == 2
    assert row["save_requests"]["PUT"] == 2 and row["load_requests"]["GET"] == 4  # summed over ranks, repeat 0
    assert row["load_bit_exact"] and row["reshard_bit_exact"]


def test_async_figures_from_hand_computed_records():
    from ckptio.bench import async_saves

    def save(blocking, background, steps, pss):
        return {
            "blocking_s": blocking,
            "background_s": background,
            "steps": steps,
            "rss_bytes": pss,
            "tree_pss_bytes": pss,
        }

    mib = 1 << 20
    records = [
        {
            "setup": "s",
            "executor": "THREAD",
            "rank": rank,
            "payload_bytes": 100 * mib,
            "sync_s": [1.0, 2.0, 3.0 + rank],
            "baseline_steps": 100,
            "baseline_s": 1.0,
            # save 1 (allocates) is left out of the blocking figures; growth is from save 2 to the last
            "saves": [
                save(0.9, 1.0, 10, 0),
                save(0.1 + rank, 1.0, 50, 10 * mib),
                save(0.3, 2.0, 100, (30 + rank) * mib),
            ],
            "mismatches": [],
        }
        for rank in (0, 1)
    ]
    (row,) = async_saves.summarize(records)
    assert row["blocking_s_median"] == (1.1 + 0.3) / 2 and row["blocking_s_min"] == 0.3  # slowest rank per save
    assert row["sync_s_median"] == 2.0 and row["blocking_over_sync"] == row["blocking_s_median"] / 2.0
    assert row["steps_per_s_before"] == 100 and row["steps_per_s_during"] == 160 / 4.0
    assert row["training_speed_during"] == 0.4
    assert row["tree_pss_growth_bytes"] == 21 * mib and row["tree_pss_growth_over_payload"] == 0.21
    assert row["bit_exact"]


def test_plan_figures_from_hand_computed_records():
    from ckptio.bench import plan_time

    records = [
        {"writer": "w", "tensors": 10, "save": k, "rank": rank, "plan_s": (5 - k) + rank, "save_s": 10.0 + k}
        for k in range(4)
        for rank in (0, 1)
    ]
    (row,) = plan_time.summarize(records)
    assert row["first_plan_s"] == 6 and row["later_plan_s_median"] == 4 and row["later_plan_s_min"] == 3
    assert row["first_save_s"] == 10.0 and row["later_save_s_median"] == 12.0


def test_process_tree_memory_counts_a_child_process():
    import subprocess
    import sys

    from ckptio.bench import async_saves

    before = async_saves.process_tree_pss()
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; b = bytearray(256 << 20); print('ok', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout.readline() == b"ok\n"
        grown = async_saves.process_tree_pss() - before
    finally:
        child.communicate(b"")
    # The child's touched 256 MiB plus its interpreter, less what the parent's own PSS drops by as the
    # child maps the same libraries (PSS splits shared pages between the processes that map them).
    assert 224 << 20 <= grown < 400 << 20


def _held_bytes_and_save(url: str, size: int, data: str = "randn") -> int:
    """Save the workload on a 2x2 mesh; return the bytes this rank holds (tensors + pickled objects)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    specs = workload.tensor_specs(size, data)
    state = workload.build_state(mesh, specs, data, dist.get_rank())
    ckptio.save(state, url)
    loaded = workload.build_state(mesh, specs, data, dist.get_rank(), empty=True)
    ckptio.load(loaded, url)
    assert workload.check_state(loaded, specs, data, dist.get_rank()) == []

    def held(value) -> int:
        if isinstance(value, dict):
            return sum(held(v) for v in value.values())
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        return len(workload._pickled(value))

    return held(state)


@pytest.mark.parametrize("data", ["randn", "adam-moments", "transformer"])
def test_workload_byte_counts_match_what_ranks_hold_and_ckptio_stores(tmp_path, data):
    from tests.helpers.harness import spawn

    url = str(tmp_path / "w")
    held = spawn(4, _held_bytes_and_save, url, 1 << 20, data)
    sizes = workload.byte_counts(workload.tensor_specs(1 << 20, data), (2, 2), data)
    assert sum(held) == sizes["logical_bytes"]
    stored = sum(i["logical_bytes"] for i in readable_metadata(url)["items"])
    assert stored == sizes["unique_bytes"]


def test_the_adam_state_holds_a_trained_models_values():
    specs = {s.name: s for s in workload.tensor_specs(4 << 20, "adam-moments")}
    weight = specs["model.layers.0.weight"]
    avg, sq = specs["optim.state.layers.0.weight.exp_avg"], specs["optim.state.layers.0.weight.exp_avg_sq"]
    assert weight.dtype == torch.bfloat16 and avg.dtype == sq.dtype == torch.float32
    w, m, v = (workload.rows_of(spec, 0, spec.rows, "adam-moments").float() for spec in (weight, avg, sq))
    assert 0.015 < w.std() < 0.025 and 0.5e-3 < m.std() < 1.5e-3 and v.min() >= 0 and v.max() < 1e-4
    assert len(workload.step_keys(list(specs.values()), "adam-moments")) == len(specs) // 3


def test_the_transformer_state_has_the_outside_harness_layout():
    """Issue 50.7's state: hidden 512, 7 layers at ~256 MiB, five matrix shapes, 1-row norms and bias, an
    uneven position table, two fp32 moments and a step per parameter."""
    specs = workload.tensor_specs(256 << 20, "transformer")
    shapes = {s.name: (s.rows, s.cols, s.dtype) for s in specs}
    assert len([n for n in shapes if n.endswith("attn.qkv.weight") and n.startswith("model.")]) == 7
    assert shapes["model.embed.weight"] == (8192, 512, torch.bfloat16)
    assert shapes["model.pos_embed"] == (1023, 512, torch.float32)
    assert shapes["model.layers.0.mlp.down.weight"] == (512, 2048, torch.bfloat16)
    assert shapes["optim.state.layers.6.norm2.weight.exp_avg_sq"] == (1, 512, torch.float32)
    assert len(workload.step_keys(specs, "transformer")) == len(specs) // 3 == 2 + 7 * 7 + 1
    sizes = workload.byte_counts(specs, (1, 1), "transformer")
    assert 200 << 20 < sizes["unique_bytes"] < 300 << 20


def _phases_and_raw(url: str) -> tuple[dict, dict, dict]:
    """One ckptio save and load through the phase timer, and the raw bandwidth of the folder."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ckptio.bench import phases

    writer = phases.timed(ckptio.Writer(url))
    own = f"loader.rank{dist.get_rank()}"
    dcp.save({"w": torch.ones(1024), own: dist.get_rank()}, storage_writer=writer)
    reader = phases.timed(ckptio.Reader(url))
    out = {"w": torch.zeros(1024), own: -1}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], torch.ones(1024)) and out[own] == dist.get_rank()
    return writer.phases, reader.phases, phases.raw_bandwidth(url + "-raw", 1 << 20)


def test_phases_time_each_writer_method_and_the_raw_bandwidth_is_measured(tmp_path):
    from tests.helpers.harness import spawn

    ranks = spawn(2, _phases_and_raw, str(tmp_path / "c"))
    for rank, (save, load, raw) in enumerate(ranks):
        assert set(save) == {"plan", "write", "finish"} and set(load) == {"metadata", "plan", "read"}
        assert min(save["plan"], save["write"], load["metadata"], load["plan"], load["read"]) > 0, (save, load)
        assert (save["finish"] > 0) == (rank == 0)  # the coordinator's step
        assert raw["bytes"] == 2 << 20 and min(raw["write_s"], raw["read_s"], raw["cached_read_s"]) > 0
    assert not [n for n in os.listdir(tmp_path) if n.startswith("c-raw") and os.listdir(tmp_path / n)]


@pytest.mark.parametrize("s3", S3_SERVERS, indirect=True)
def test_s3_requests_are_counted_on_the_client(s3):
    base, options = s3
    counting.install_s3_counter()
    counting.take_counts()
    ckptio.save(
        {"w": torch.ones(1000)},
        f"{base}/counted",
        ckptio.WriterConfig(tuning=ckptio.Tuning(inline_limit=0)),
        storage_options=options,
    )
    counts = counting.take_counts()
    assert counts["PUT"] == 2 and counts["GET"] == 1  # data object, metadata; the existence check
    assert sum(counts.values()) == 3
    ckptio.load({"w": torch.zeros(1000)}, f"{base}/counted", storage_options=options)
    assert counting.take_counts()["GET"] == 2  # metadata, one ranged read


def test_throttled_answers_are_counted_apart_from_the_requests(s3_proxy):
    proxy, base, options = s3_proxy
    counting.install_s3_counter()
    counting.take_counts()
    proxy.faults.append(Fault(lambda r: r.operation == "PUT", 503, times=2))
    ckptio.save(
        {"w": torch.ones(1000)},
        f"{base}/counted",
        ckptio.WriterConfig(tuning=ckptio.Tuning(inline_limit=0)),
        storage_options=options,
    )
    counts = counting.take_counts()
    assert counts["PUT"] == 4 and counts[counting.THROTTLED] == 2  # each 503 is one of the 4 PUTs sent
    assert report.total_requests(counts) == 5


@pytest.mark.slow
def test_bench_cli_on_the_embedded_default(tmp_path, capsys):
    out = str(tmp_path / "results")
    args = [
        "--ranks",
        "2",
        "--mesh",
        "1x2",
        "--size",
        "2MiB",
        "--out",
        out,
        "--quiet",
        "--writers",
        "ckptio all_ranks",
        "ckptio replica_group",
        "FileSystemWriter",
        "FsspecWriter",
        "--async-saves",
        "2",
        "--plan-tensors",
        "10",
        "--lagging-saves",
        "3",
    ]
    assert bench_main(args) == 0
    printed = capsys.readouterr().out
    assert "ckptio all_ranks" in printed and "S3 requests" in printed
    (path,) = glob.glob(os.path.join(out, "*.json"))
    doc = json.load(open(path))
    assert doc["schema_version"] == report.SCHEMA_VERSION
    assert set(doc) >= {"created", "versions", "machine", "config", "results"}
    assert doc["config"]["mesh"] == [1, 2] and doc["config"]["ranks"] == 2
    rows = {(r["target"], r["writer"]) for r in doc["results"]}
    assert rows == {
        ("local", "ckptio all_ranks"),
        ("local", "ckptio replica_group"),
        ("local", "torch FileSystemWriter"),
        ("local", "torch FsspecWriter"),
        ("s3 (moto)", "ckptio all_ranks"),
        ("s3 (moto)", "ckptio replica_group"),
        ("s3 (moto)", "torch FsspecWriter"),
    }
    numeric = (
        "save_s_median",
        "load_s_median",
        "bytes_written",
        "dedup_ratio",
        "write_amplification",
        "objects",
        "largest_rank_bytes",
        "mean_rank_bytes",
        "peak_rss_save_bytes",
    )
    for row in doc["results"]:
        assert all(isinstance(row[k], (int, float)) for k in numeric)
        assert row["load_bit_exact"] and row["reshard_bit_exact"]
        assert set(row["save_requests"]) == {*counting.REQUEST_KINDS, counting.THROTTLED}
        assert row["save_requests"][counting.THROTTLED] == row["load_requests"][counting.THROTTLED] == 0
        if row["writer"].startswith("ckptio") and row["target"] != "local":
            assert row["save_requests"]["COPY"] == row["save_requests"]["LIST"] == 0
    asynchronous = {(r["setup"], r["executor"]) for r in doc["async_saves"]}
    assert asynchronous == {
        (setup, executor)
        for setup in ("ckptio plain call", "torch FileSystemWriter")  # the stagers' rows: --all-stagers
        for executor in ("THREAD", "PROCESS")
    }
    for row in doc["async_saves"]:
        assert row["bit_exact"] and row["saves"] == 2
        assert 0 < row["blocking_s_median"] and 0 < row["steps_per_s_during"] and 0 < row["payload_bytes"]
    assert {(r["writer"], r["tensors"]) for r in doc["plan_time"]} == {
        ("ckptio all_ranks", 10),
        ("torch FileSystemWriter", 10),
    }
    assert "Asynchronous saves" in printed and "Plan time" in printed and "Tiered saves" in printed
    (tiered,) = doc["tiered"]  # the embedded S3 server, fast tiers in the temp dir
    assert tiered["target"] == "s3 (moto)" and tiered["bit_exact"] and tiered["latest_agreed"]
    assert tiered["fast_load_durable_bytes"] == 0 and tiered["emptied_others_s3_bytes"] == 0
    # what the emptied rank needs, and at most one merged gap more (read_gap_bytes on S3: a small
    # scalar at the end of rank 0's 1 MiB file is read with the objects at its start in one GET)
    needed = tiered["emptied_needed_bytes"]
    assert needed <= tiered["emptied_s3_bytes"] <= needed + REMOTE_READ_GAP_BYTES
    assert tiered["rss_growth_saves"] == 8 and tiered["save_and_drain_cpu_s"]["median"] > 0
    lagging = {r["drain"]: r for r in doc["tiered_lagging"]}  # saves faster than a drain at half their rate
    assert set(lagging) == {"half", "unlimited"} and all(r["bit_exact"] for r in lagging.values())
    assert lagging["half"]["saves_over_budget"] == 0 and lagging["half"]["saves"] == 3
    for made in (".md", ".png", "-async.png"):
        assert os.path.exists(path.replace(".json", made))
    # against that run, one writer on the local target alone (a row of its own, compared)
    again = [*args[: args.index("--writers")], "--writers", "ckptio all_ranks", "--path", str(tmp_path / "again")]
    skip_sections = ["--async-saves", "0", "--plan-tensors", "none", "--no-tiered"]
    assert bench_main(again + ["--compare", path, "--no-charts", *skip_sections]) == 0
    printed = capsys.readouterr().out
    assert "against" in printed and "Asynchronous saves" not in printed and "Plan time" not in printed
    assert "Tiered saves" not in printed and "s3 (moto)" not in printed
    (compared,) = [line for line in printed.splitlines() if line.startswith("local  ckptio all_ranks  ")]
    assert "%" in compared and "(new)" not in compared


@pytest.mark.parametrize("layout", ["hsdp", "fsdp", "fsdp_tp"])
def test_scale_simulation_runs_both_writers_on_valid_plans(layout):
    from ckptio.bench import scale

    # 16 ranks, 1 layer: 12 parameters x (weight, 2 moments) shards + 12 steps + 5 param_groups + 1 loader
    rows = [scale.simulate(writer, layout, 16, 1) for writer in ("ckptio", "torch")]
    for row in rows:
        assert row["items"] == 16 * 54
        assert row["metadata_bytes"] > 0 and row["gathered_plan_bytes"] > 0
        assert min(row["global_plan_s"], row["finish_s"], row["decode_s"]) > 0
    # torch's planner validated the plans (exact cover) and ckptio decoded its own metadata back
    assert rows[0]["writer"] == "ckptio" and rows[1]["writer"] == "torch"
    assert rows[0]["metadata_read_bytes"] == rows[0]["metadata_bytes"]  # one rank reads, for all 16
    assert rows[1]["metadata_read_bytes"] == 16 * rows[1]["metadata_bytes"]


def test_scale_layouts_split_like_dtensor(capsys):
    from ckptio.bench import scale

    assert scale.chunk_of("layers.0.attention.wq.weight", (8192, 8192), "fsdp", 1024, 3) == ((24, 0), (8, 8192))
    # column-wise TP shards rows 8 ways, FSDP (1024 / 8 = 128) splits each TP slice's rows again
    assert scale.chunk_of("layers.0.attention.wq.weight", (8192, 8192), "fsdp_tp", 1024, 9) == ((1032, 0), (8, 8192))
    # row-wise TP shards columns; a norm is not TP-sharded
    assert scale.chunk_of("layers.0.feed_forward.w2.weight", (8192, 28672), "fsdp_tp", 1024, 9) == (
        (64, 3584),
        (64, 3584),
    )
    assert scale.chunk_of("norm.weight", (8192,), "fsdp_tp", 1024, 9) == ((64,), (64,))
    # HSDP: 128-way shards, replica 1 holds what replica 0 does; FSDP's last ranks of a 32000-row tensor are empty
    assert scale.chunk_of("output.weight", (32000, 8192), "hsdp", 1024, 128 + 5) == ((1250, 0), (250, 8192))
    assert scale.chunk_of("output.weight", (32000, 8192), "fsdp", 1024, 1023) == ((32000, 0), (0, 8192))
    # an empty FSDP slice of TP slice 0 must not take the index of TP slice 1's first chunk
    assert scale.chunk_of("output.weight", (32000, 8192), "fsdp_tp", 1024, 125 * 8) == ((32000, 0), (0, 8192))
    assert scale.parse_points("1024:8, 8192") == [(1024, 8), (8192, 80)]
    with pytest.raises(SystemExit) as refused:
        scale.parse_points("1001")
    assert refused.value.code == 2 and "multiple of 8" in capsys.readouterr().err


def test_compressed_runs_also_save_the_training_state_with_the_zstd_writers():
    from ckptio.bench.__main__ import _training_state_pass, parse_args
    from ckptio.bench.writers import select

    targets = [{"name": "local", "kind": "local", "base": "/x"}, {"name": "s3 (moto)", "kind": "s3", "base": "s3://b"}]

    def pass_for(*argv):
        args = parse_args(["--out", "/tmp/ckptio-bench-test-out", *argv])
        cfg = {"data": args.data, "targets": targets, "shared_reads": True}
        return _training_state_pass(args, cfg, select(args.writers, args.compressed), targets)

    state_cfg, steps = pass_for("--compressed", "--repeats", "3")
    zstd = ["ckptio all_ranks+zstd", "ckptio replica_group+zstd", "torch FileSystemWriter+zstd"]
    assert state_cfg["data"] == "bf16-weights" and state_cfg["writers"] == zstd and steps == 9
    assert [t["name"] for t in state_cfg["targets"]] == ["local bf16-weights"] and not state_cfg["shared_reads"]
    assert state_cfg["targets"][0]["base"] == "/x/bf16-weights"
    assert pass_for() is None  # not compressed
    assert pass_for("--compressed", "--data", "bf16-weights") is None  # the run's own state already
    assert pass_for("--compressed", "--writers", "ckptio all_ranks") is None  # no compressed writer chosen


def test_the_s3_client_benchmark_reads_back_what_each_client_wrote(moto_server):
    from ckptio.bench import s3_clients

    server = {"endpoint": moto_server, "key": "testing", "secret": "testing"}
    s3_clients._create_bucket(server)
    rows = [
        {"server": "moto", **s3_clients.measure_one(client, server, 2 << 20, 5 << 20, 1, signed)}
        for client in ("ckptio", "s3fs")
        for signed in (True, False)
    ]  # each measurement checks the bytes read back
    for row in rows:
        assert row["upload_cpu_s_per_gib"][0] > 0 and row["download_mb_s"][1] > 0
    assert "| moto | s3fs | unsigned |" in s3_clients.table(rows)


def test_the_writers_without_a_coordinator_run_only_when_named():
    from ckptio.bench.writers import select

    assert not [w for w in select(None, compressed=True) if "no-coordinator" in w.name]
    chosen = select(["no-coordinator"], compressed=False)
    assert [w.name for w in chosen] == ["ckptio all_ranks no-coordinator", "ckptio replica_group no-coordinator"]
    assert all(w.save_options == {"use_collectives": False} for w in chosen)


@pytest.mark.slow
def test_the_incremental_section_writes_only_what_changed_and_loads_bit_exact(tmp_path, capsys):
    out = str(tmp_path / "results")
    args = ["--ranks", "2", "--mesh", "1x2", "--size", "2MiB", "--out", out, "--quiet", "--no-charts"]
    args += ["--writers", "ckptio replica_group", "--async-saves", "0", "--no-tiered", "--incremental"]
    assert bench_main([*args, "--incremental-states", "lora", "--incremental-depth", "2"]) == 0
    assert "Incremental saves" in capsys.readouterr().out
    (path,) = glob.glob(os.path.join(out, "*.json"))
    rows = {(r["state"], r["target"]): r for r in json.load(open(path))["incremental"]}
    assert set(rows) == {("lora", "local"), ("lora", "s3 (moto)")}
    for row in rows.values():  # the adapters changed whole: exactly their bytes written, the rest referenced
        assert row["bit_exact"] and row["deep_depth"] == 2 and row["repeats"] == 1 and row["rss_growth_saves"] == 4
        assert row["written_bytes"]["median"] < 0.2
        assert row["data_over_changed"] == pytest.approx(1.0, abs=0.01)
    with pytest.raises(SystemExit):
        bench_main([*args, "--incremental-states", "lora,dense"])


@pytest.mark.slow
def test_bench_cli_runs_every_store_target_beside_moto_and_refuses_an_unknown_one(
    gcs_server, azure_server, tmp_path, capsys
):
    """(The emulator fixtures skip this, saying why, where either cannot run; the bench starts its own.)"""
    out = str(tmp_path / "results")
    args = ["--ranks", "2", "--mesh", "1x2", "--size", "2MiB", "--out", out, "--quiet", "--no-tiered"]
    args += ["--no-tiered-lagging", "--writers", "ckptio all_ranks", "FsspecWriter"]
    assert bench_main([*args, "--target", "moto", "--target", "gcs", "--target", "azure"]) == 0
    (path,) = glob.glob(os.path.join(out, "*.json"))
    results = json.load(open(path))["results"]
    assert {(r["target"], r["writer"]) for r in results} == {
        (target, writer)
        for target in ("s3 (moto)", "gcs (fake-gcs-server)", "azure (Azurite)")
        for writer in ("ckptio all_ranks", "torch FsspecWriter")
    }
    assert all(r["load_bit_exact"] and r["reshard_bit_exact"] for r in results)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        bench_main([*args, "--target", "hdfs"])
    assert "--target hdfs: gcs, azure, moto, or a gs:// or az:// URL" in capsys.readouterr().err
