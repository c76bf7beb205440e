"""The per-rank body of a benchmark run: save and load every writer on every target, timed."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from . import counting, phases, workload
from .writers import WRITERS


def mesh_of(shape: tuple[int, int], device: str):
    """The benchmark's ("replicate", "shard") device mesh."""
    return init_device_mesh(device, shape, mesh_dim_names=("replicate", "shard"))


def rank_state(cfg: dict) -> tuple[int, object, list, dict]:
    """This rank's ``(rank, mesh, specs, state)`` of the run's workload, on its device."""
    rank = dist.get_rank()
    if cfg["device"] == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = mesh_of(tuple(cfg["mesh"]), cfg["device"])
    specs = workload.tensor_specs(cfg["size_bytes"], cfg["data"])
    return rank, mesh, specs, workload.build_state(mesh, specs, cfg["data"], rank)


def report_progress(cfg: dict, *fields: object) -> None:
    """One line in the progress file the parent process counts (rank 0 only)."""
    if dist.get_rank() == 0 and cfg.get("progress_file"):
        with open(cfg["progress_file"], "a") as f:
            f.write("\t".join(map(str, fields)) + "\n")


def remove_together(url: str) -> None:
    """Delete a local benchmark checkpoint once every rank is done with it (rank 0 deletes)."""
    dist.barrier()
    if dist.get_rank() == 0:
        counting.remove(url, None)
    dist.barrier()


def _slug(writer_name: str) -> str:
    return writer_name.replace(" ", "_").replace("+", "_")


def _timed(fn) -> float:
    dist.barrier()
    start = counting.now()
    fn()
    elapsed = counting.now() - start
    dist.barrier()
    return elapsed


def _warm_up(cfg: dict, writers: dict, mesh) -> None:
    """One tiny untimed save and load per writer and target, so clients, sessions and imports are not
    timed. Its tensor is split over both mesh dimensions, so every rank writes a chunk of its own (a
    replicated tensor is written by one rank, and the others' clients would start in the first
    timed save: ~0.2 CPU-s each, loading botocore's service models); 128 KiB a chunk, so that no rank's
    part is small enough to go inline into the metadata."""
    rows, cols = mesh.shape
    chunk = (2, 16 << 10)  # float32
    tiny = {"warmup": distribute_tensor(torch.zeros(chunk[0] * rows, chunk[1] * cols), mesh, [Shard(0), Shard(1)])}
    for target in cfg["targets"]:
        for name in cfg["writers"]:
            spec = writers[name]
            if target["kind"] in cfg["writer_targets"][name]:
                url = f"{target['base']}/warmup/{_slug(name)}"
                dcp.save(tiny, storage_writer=spec.make_writer(url, target.get("storage_options")), **spec.save_options)
                dcp.load(tiny, storage_reader=spec.make_reader(url, target.get("storage_options")))


def run_rank(cfg: dict) -> list[dict]:
    """Return one record per (target, writer, repeat) with this rank's timings and counts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    counting.install_s3_counter()
    specs = workload.tensor_specs(cfg["size_bytes"], cfg["data"])
    if cfg["device"] == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = mesh_of(tuple(cfg["mesh"]), cfg["device"])
    reshard_mesh = mesh_of((1, world), cfg["device"])
    state = workload.build_state(mesh, specs, cfg["data"], rank)
    if cfg.get("shared_reads"):  # built once: each mesh makes process groups
        cfg = {**cfg, "load_meshes": {shape: mesh_of(shape, cfg["device"]) for shape in _load_shapes(cfg["mesh"])}}
    writers = {w.name: w for w in WRITERS}
    _warm_up(cfg, writers, mesh)
    records = []
    per_rank = workload.byte_counts(specs, tuple(cfg["mesh"]), cfg["data"])["unique_bytes"] // world
    for target in cfg["targets"]:  # untimed, as the writers' warm-up: the first writes meet fresh memory
        if target["kind"] == "local":
            phases.raw_bandwidth(os.path.join(target["base"], "raw"), per_rank)
    # Repeats outermost: every writer sees the same page-cache and writeback conditions.
    for rep in range(cfg["repeats"]):
        for target in cfg["targets"]:
            if target["kind"] == "local":  # what the disk gives in the same conditions, to compare with
                raw = phases.raw_bandwidth(os.path.join(target["base"], "raw"), per_rank)
                records.append({"raw_bandwidth": raw, "target": target["name"], "rank": rank, "repeat": rep})
        for target in cfg["targets"]:
            for name in cfg["writers"]:
                if target["kind"] in cfg["writer_targets"][name]:
                    records.append(_measure(writers[name], target, rep, state, mesh, reshard_mesh, specs, cfg, rank))
                    report_progress(cfg, target["name"], name, rep)
    return records


def _measure(spec, target: dict, rep: int, state: dict, mesh, reshard_mesh, specs, cfg: dict, rank: int) -> dict:
    options = target.get("storage_options")
    compressible = cfg["data"]
    url = f"{target['base']}/{_slug(spec.name)}/rep{rep}"
    record = {
        "target": target["name"],
        "target_kind": target["kind"],
        "writer": spec.name,
        "repeat": rep,
        "rank": rank,
        "url": url,
    }
    counting.take_counts()
    cpu = counting.cpu_seconds()
    writer = phases.timed(spec.make_writer(url, options))
    with counting.PeakRSS() as rss:
        record["save_s"] = _timed(
            lambda: dcp.save(state, storage_writer=writer, planner=spec.make_planner(), **spec.save_options)
        )
    record["save_phases"] = writer.phases
    record["save_cpu_s"] = counting.cpu_seconds() - cpu
    record["save_requests"] = counting.take_counts()
    record["save_rss_bytes"] = rss.peak_delta

    loaded = workload.build_state(mesh, specs, compressible, rank, empty=True)
    cpu = counting.cpu_seconds()
    reader = phases.timed(spec.make_reader(url, options))
    with counting.PeakRSS() as rss:
        record["load_s"] = _timed(lambda: dcp.load(loaded, storage_reader=reader))
    record["load_phases"] = reader.phases
    record["load_cpu_s"] = counting.cpu_seconds() - cpu
    record["load_requests"] = counting.take_counts()
    record["load_rss_bytes"] = rss.peak_delta
    record["load_mismatches"] = workload.check_state(loaded, specs, compressible, rank)
    record["loaded_bytes"] = workload.held_tensor_bytes(loaded)

    if cfg.get("shared_reads"):  # every writer's checkpoint, torch's with torch's reader
        record["shared_reads"] = _shared_read_loads(spec, url, options, specs, cfg, rank)
    if rep == 0:
        resharded = workload.build_state(reshard_mesh, specs, compressible, rank, empty=True)
        record["reshard_load_s"] = _timed(lambda: dcp.load(resharded, storage_reader=spec.make_reader(url, options)))
        record["reshard_load_requests"] = counting.take_counts()
        record["reshard_mismatches"] = workload.check_state(resharded, specs, compressible, rank)
    dist.barrier()
    if rank == 0:  # after the counts were taken: listing and cleanup are not part of the measurement
        record["listing"] = counting.checkpoint_files(url, options)
        if rep == 0:
            record["bytes_by_dtype"] = counting.bytes_by_dtype(url, options)
        if not cfg["keep"]:
            counting.remove(url, options)
    dist.barrier()
    return record


def _load_shapes(mesh: list[int]) -> list[tuple[int, int]]:
    """The saved mesh, all replicas (Wx1) and all shards (1xW): the loads ``--shared-reads`` times."""
    world = mesh[0] * mesh[1]
    return list(dict.fromkeys([tuple(mesh), (world, 1), (1, world)]))


def _shared_read_loads(spec, url: str, options, specs, cfg: dict, rank: int) -> list[dict]:
    """Load on each mesh of ``_load_shapes`` with each ``dedup_reads`` (torch's reader once);
    this rank's time, bytes served to it and GETs."""
    import ckptio

    modes = [False, True, "auto"] if spec.name.startswith("ckptio") else [None]
    out = []
    for shape, mesh in cfg["load_meshes"].items():
        for mode in modes:
            loaded = workload.build_state(mesh, specs, cfg["data"], rank, empty=True)
            if mode is None:
                reader = spec.make_reader(url, options)
            else:
                reader = ckptio.Reader(url, storage_options=options, dedup_reads=mode)
            counting.take_counts()
            counting.take_served_bytes()
            seconds = _timed(lambda loaded=loaded, reader=reader: dcp.load(loaded, storage_reader=reader))
            out.append(
                {
                    "mesh": f"{shape[0]}x{shape[1]}",
                    "dedup_reads": "torch reader" if mode is None else str(mode),
                    "load_s": seconds,
                    "served_bytes": counting.take_served_bytes(),
                    "gets": counting.take_counts()["GET"],
                    "bit_exact": not workload.check_state(loaded, specs, cfg["data"], rank),
                }
            )
    return out
