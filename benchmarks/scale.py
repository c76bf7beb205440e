"""``--scale 1024,8192``: the coordinator's work and the metadata size at thousands of ranks,
simulated in one process (no ranks, no data), for ckptio and torch's FileSystemWriter.

Each rank's local save plan is built as torch's ``DefaultSavePlanner`` would build it for a
Llama-70B-like training state (model, AdamW moments and step per parameter, a few replicated
objects and one data-loader object per rank) under one of three layouts: ``hsdp`` (replicas of
128-way shards), ``fsdp`` (every rank holds a slice of every tensor) and ``fsdp_tp`` (8-way tensor
parallel inside FSDP, strided where both shard the same dimension). The write results are those
the writers' ``write_data`` would return. Timed, on the same plans for both writers:

- ``global plan``: the planner's ``create_global_plan`` (dedup, metadata, validation; ckptio rows use
  ``ckptio.SavePlanner``, torch rows ``DefaultSavePlanner``) and the writer's ``prepare_global_plan``
  (ckptio: who writes what);
- ``finish``: the writer's ``finish`` (ckptio: object checks, encoding, commit of ``ckptio.json``;
  torch: pickling ``.metadata``), on a local directory;
- ``decode``: reading the metadata back as one loading rank does (ckptio: parse and validate; both: the
  storage record of each key's first chunk looked up, as rank 0's load reads them), the median of
  ``DECODE_REPEATS`` (with its range);
  the metadata bytes one load reads in all: once (ckptio), or once per rank (torch).

``layers`` cuts the 80 transformer layers down so that a run fits in memory: every local plan is
held at once, as the coordinator holds them (about 1 KiB per item).
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import tempfile
import time
from typing import Callable, Iterator

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from . import usage_error

LAYOUTS = ("hsdp", "fsdp", "fsdp_tp")
#: Simulated per point: ckptio and torch with a coordinator, ckptio without (``dcp.save(..., use_collectives=False)``).
WRITERS = ("ckptio", "torch", "ckptio no-coordinator")
HSDP_SHARDS = 128
TP = 8
VOCAB, DIM, KV_DIM, FFN = 32000, 8192, 1024, 28672
#: TP placement of each parameter (torchtitan's Llama plan): column-wise shards dim 0, row-wise dim 1.
COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3", "output")
ROWWISE = ("attention.wo", "feed_forward.w2", "tok_embeddings")


def llama_parameters(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    params = [("tok_embeddings.weight", (VOCAB, DIM))]
    for i in range(layers):
        p = f"layers.{i}."
        params += [
            (p + "attention.wq.weight", (DIM, DIM)),
            (p + "attention.wk.weight", (KV_DIM, DIM)),
            (p + "attention.wv.weight", (KV_DIM, DIM)),
            (p + "attention.wo.weight", (DIM, DIM)),
            (p + "feed_forward.w1.weight", (FFN, DIM)),
            (p + "feed_forward.w2.weight", (DIM, FFN)),
            (p + "feed_forward.w3.weight", (FFN, DIM)),
            (p + "attention_norm.weight", (DIM,)),
            (p + "ffn_norm.weight", (DIM,)),
        ]
    return params + [("norm.weight", (DIM,)), ("output.weight", (VOCAB, DIM))]


def _split(length: int, parts: int, index: int) -> tuple[int, int]:
    """DTensor's Shard split (torch.chunk: ceil-sized, trailing parts short or empty): (offset, size)."""
    chunk = -(-length // parts)
    start = min(index * chunk, length)
    return start, min(start + chunk, length) - start


def chunk_of(name: str, shape: tuple[int, ...], layout: str, ranks: int, rank: int) -> tuple[tuple, tuple]:
    """(offsets, sizes) of the slice ``rank`` holds."""
    offsets, sizes = [0] * len(shape), list(shape)
    if layout == "hsdp":
        offsets[0], sizes[0] = _split(shape[0], min(HSDP_SHARDS, ranks), rank % min(HSDP_SHARDS, ranks))
    elif layout == "fsdp":
        offsets[0], sizes[0] = _split(shape[0], ranks, rank)
    else:
        fsdp, tp_index, fsdp_index = ranks // TP, rank % TP, rank // TP
        tp_dim = 0 if any(k in name for k in COLWISE) else 1 if any(k in name for k in ROWWISE) else None
        if tp_dim is not None and tp_dim < len(shape):
            offsets[tp_dim], sizes[tp_dim] = _split(shape[tp_dim], TP, tp_index)
        # FSDP shards dim 0 of what TP left this rank (strided when TP split dim 0 too)
        inner_offset, sizes[0] = _split(sizes[0], fsdp, fsdp_index)
        # an empty slice sits at the end of the dimension, as DTensor places empty shards: at the end
        # of its TP slice it would share its index with the next slice's first chunk
        offsets[0] = offsets[0] + inner_offset if sizes[0] else shape[0]
    return tuple(offsets), tuple(sizes)


def local_plans(layout: str, ranks: int, layers: int) -> list[SavePlan]:
    """Every rank's local save plan, as torch's DefaultSavePlanner makes it."""
    params = llama_parameters(layers)
    fp32 = TensorProperties(dtype=torch.float32)
    keyed = []
    # flattened key -> path in the nested state, as torch's flatten_state_dict records it for
    # {"model": model_state_dict, "optim": optim_state_dict, "dataloader": {...}}
    mappings: dict[str, tuple] = {}
    for name, shape in params:
        mappings[f"model.{name}"] = ("model", name)
        for moment in ("exp_avg", "exp_avg_sq"):
            mappings[f"optim.state.{name}.{moment}"] = ("optim", "state", name, moment)
        for key in (f"model.{name}", f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq"):
            keyed.append((key, name, shape, torch.Size(shape)))
    step_chunk = ChunkStorageMetadata(offsets=torch.Size(()), sizes=torch.Size(()))
    shared_items = [
        WriteItem(
            index=MetadataIndex(f"optim.state.{name}.step", torch.Size(())),
            type=WriteItemType.TENSOR,
            tensor_data=TensorWriteData(chunk=step_chunk, properties=fp32, size=torch.Size(())),
        )
        for name, _ in params
    ]
    shared_items += [
        WriteItem(index=MetadataIndex(f"optim.param_groups.0.{k}"), type=WriteItemType.BYTE_IO)
        for k in ("lr", "betas", "eps", "weight_decay", "params")
    ]
    mappings.update({f"optim.state.{name}.step": ("optim", "state", name, "step") for name, _ in params})
    mappings.update(
        {
            item.index.fqn: ("optim", "param_groups", 0, item.index.fqn.split(".")[-1])
            for item in shared_items[len(params) :]
        }
    )
    plans = []
    for rank in range(ranks):
        items = []
        for key, name, shape, size in keyed:
            offsets, sizes = chunk_of(name, shape, layout, ranks, rank)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items.append(
                WriteItem(
                    index=MetadataIndex(key, chunk.offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=fp32, size=size),
                )
            )
        items += shared_items
        items.append(WriteItem(index=MetadataIndex(f"dataloader.dp_rank_{rank}"), type=WriteItemType.BYTE_IO))
        own = {f"dataloader.dp_rank_{rank}": ("dataloader", f"dp_rank_{rank}")}
        plans.append(SavePlan(items, planner_data={**mappings, **own}))
    return plans


def _ckptio_result(item: WriteItem, rank: int, offset: int, block_size: int):
    from ckptio.format.names import Codec, ItemKind
    from ckptio.format.records import StoredItem

    if item.type == WriteItemType.BYTE_IO:
        logical, kind, dtype, shape = 64, ItemKind.BYTES, None, None
    else:
        shape = tuple(item.tensor_data.chunk.sizes)
        logical, kind, dtype = 4 * torch.Size(shape).numel(), ItemKind.TENSOR, "float32"
    blocks = tuple((min(block_size, logical - k), 0x1234ABCD) for k in range(0, logical, block_size))
    record = StoredItem(
        f"data-0123456789abcdef-r{rank:05d}.ckio", offset, logical, kind, dtype, shape, Codec.RAW, block_size, blocks
    )
    return WriteResult(item.index, record.stored_bytes, record)  # as write_data reports it (its size cached)


def ckptio_results(plans: list[SavePlan], block_size: int) -> list[list[WriteResult]]:
    """What each rank's ckptio ``write_data`` returns for its final plan (with its object report)."""
    from ckptio.saving.consistency import ObjectReport, attach_report

    out = []
    for rank, plan in enumerate(plans):
        results, offset = [], 0
        for item in plan.items:
            result = _ckptio_result(item, rank, offset, block_size)
            offset += result.size_in_bytes
            results.append(result)
        digests = {f"optim.param_groups.0.{k}": ("object", 8, "same") for k in ("lr", "betas", "eps")}
        digests[f"dataloader.dp_rank_{rank}"] = ("object", 8, f"r{rank}")
        out.append(attach_report(results, ObjectReport(rank, digests)))
    return out


def torch_results(plans: list[SavePlan]) -> list[list[WriteResult]]:
    """What each rank's torch FileSystemWriter ``write_data`` returns (one file per rank)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    out = []
    for rank, plan in enumerate(plans):
        results, offset = [], 0
        for item in plan.items:
            length = 64 if item.type == WriteItemType.BYTE_IO else 4 * item.tensor_data.chunk.sizes.numel()
            results.append(WriteResult(item.index, length, _StorageInfo(f"__{rank}_0.distcp", offset, length)))
            offset += length
        out.append(results)
    return out


@contextlib.contextmanager
def _timed(seconds: dict[str, float], phase: str) -> Iterator[None]:
    """Record the seconds the block takes under ``phase`` (garbage collected before, as each phase starts alike)."""
    gc.collect()
    start = time.perf_counter()
    yield
    seconds[phase] = time.perf_counter() - start


#: Times the metadata of one point is decoded (read, merged, decoded): the median is reported, beside
#: the range (the machine is shared; one decode of 8,192 fragments varied by 20% between runs).
DECODE_REPEATS = 5


def _decode_times(decode: Callable[[], None]) -> dict[str, float]:
    """``decode_s`` (the median of ``DECODE_REPEATS`` runs, each after a collection) and its range."""
    times = []
    for _ in range(DECODE_REPEATS):
        gc.collect()
        start = time.perf_counter()
        decode()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"decode_s": times[len(times) // 2], "decode_min_s": times[0], "decode_max_s": times[-1]}


def _resolve_first_chunks(metadata: Metadata) -> None:
    """Look up the storage record of every key's first chunk, as the load of rank 0 does for what it
    reads (ckptio builds item records on first use; torch's are built while unpickling)."""
    for fqn, md in metadata.state_dict_metadata.items():
        if fqn.startswith("dataloader.") and fqn != "dataloader.dp_rank_0":
            continue  # another rank's own state
        chunks = getattr(md, "chunks", None)
        index = MetadataIndex(fqn, chunks[0].offsets, 0) if chunks else MetadataIndex(fqn)
        if index in metadata.storage_data:
            metadata.storage_data[index]


def simulate(writer: str, layout: str, ranks: int, layers: int) -> dict:
    """Run the coordinator's steps for ``writer`` ("ckptio" or "torch") on synthetic plans."""
    plans = local_plans(layout, ranks, layers)
    items = sum(len(p.items) for p in plans)
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="ckptio-scale-") as root:
        path = os.path.join(root, "ckpt")
        if writer == "ckptio":
            import ckptio
            from ckptio.format.document import decode_metadata

            storage = ckptio.Writer(path)
            storage.set_up_storage_writer(True, rank=0)
            plans = [storage.prepare_local_plan(p) for p in plans]  # each rank's own step, not the coordinator's
        else:
            from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

            storage = FileSystemWriter(path)
            storage.set_up_storage_writer(True, rank=0)
            plans = [storage.prepare_local_plan(p) for p in plans]
        gathered_bytes = sum(len(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)) for p in _sample(plans))
        gathered_bytes = gathered_bytes * len(plans) // len(_sample(plans))
        # each writer with the planner its users get: ckptio.save and the torchtitan integration use
        # ckptio.SavePlanner, torch's dcp.save the DefaultSavePlanner
        planner = DefaultSavePlanner() if writer == "torch" else _ckptio_planner()
        planner.is_coordinator = True
        with _timed(seconds, "global_plan"):
            global_plans, metadata = planner.create_global_plan(plans)
            final = storage.prepare_global_plan(global_plans)
        del plans, global_plans
        results = (
            ckptio_results(final, storage.config.tuning.max_block_size) if writer == "ckptio" else torch_results(final)
        )
        del final
        with _timed(seconds, "finish"):
            storage.finish(metadata, results)
        # A loading rank decodes without the coordinator's millions of plan objects alive beside it; with
        # them, fewer of torch's unpickled objects reach the collector's full passes (~50 ms rather than
        # ~200 ms for 8,192 ranks x 1 layer of HSDP; ckptio pauses the collector while it decodes).
        del results, metadata, planner, storage
        name = "ckptio.json" if writer == "ckptio" else ".metadata"
        metadata_bytes = os.path.getsize(os.path.join(path, name))

        def decode() -> None:
            if writer == "ckptio":
                with open(os.path.join(path, name), "rb") as f:
                    decoded = decode_metadata(f.read(), name).metadata
            else:
                decoded = FileSystemReader(path).read_metadata()
            _resolve_first_chunks(decoded)

        decoded_in = _decode_times(decode)
    return {
        "writer": writer,
        "layout": layout,
        "ranks": ranks,
        "layers": layers,
        "items": items,
        "global_plan_s": seconds["global_plan"],
        "finish_s": seconds["finish"],
        **decoded_in,
        "metadata_bytes": metadata_bytes,
        # what one load of all ranks reads: ckptio's lowest rank reads and shares it (read_once.py),
        # torch's readers read it on every rank
        "metadata_read_bytes": metadata_bytes * (1 if writer == "ckptio" else ranks),
        "gathered_plan_bytes": gathered_bytes,
    }


def simulate_without_coordinator(layout: str, ranks: int, layers: int) -> dict:
    """ckptio saving without collectives: every rank plans, writes and commits its own fragment from its
        own plan alone (timed per rank, all ranks run in turn; one rank's peak Python memory traced), then
        rank 0 merges them into ``ckptio.json``, as a save does (``saving/merge_once.py``): ``merged_decode`` is
    a load's decode of it; ``decode``, one loading rank's merge where the merged document is missing (list,
    read and merge the fragments, decode the result)."""
    import tracemalloc

    import ckptio
    from ckptio.format.document import decode_metadata
    from ckptio.loading.reader import read_metadata_bytes
    from ckptio.saving.fragments import FragmentSave
    from ckptio.saving.merge_once import wait_for_merges
    from ckptio.saving.replicas import split_by_holders
    from ckptio.storage import open_store

    plans = local_plans(layout, ranks, layers)
    items = sum(len(p.items) for p in plans)
    # who holds each DTensor chunk: the ranks whose plans name it (replicas compute it from the mesh)
    holders: dict[MetadataIndex, list[int]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.type == WriteItemType.SHARD:
                holders.setdefault(item.index, []).append(rank)
    plan_s, finish_s, peak = [], [], 0
    with tempfile.TemporaryDirectory(prefix="ckptio-scale-") as root:
        path = os.path.join(root, "ckpt")
        # rank 0 last: its merge starts once every fragment is there (ranks of one process share its merges)
        for rank, plan in [*list(enumerate(plans))[1:], (0, plans[0])]:
            traced = rank == 0
            if traced:
                tracemalloc.start()
            start = time.perf_counter()
            writer = ckptio.Writer(path)
            writer.set_up_storage_writer(rank == 0, rank=rank)
            writer._fragment = FragmentSave("0123456789abcdef0123456789abcdef", ranks)
            local = writer.prepare_local_plan(plan)
            planner = _ckptio_planner()
            planner.is_coordinator = True
            (final,), metadata = planner.create_global_plan([local])
            writer.prepare_global_plan([final])
            own = split_by_holders(
                {item.index: item for item in final.items},
                lambda item, held_by=holders, me=rank: tuple(held_by.get(item.index, (me,))),
                rank,
                "all_ranks",
            )
            plan_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            results, offset = [], 0
            for item in own.written.values():
                result = _ckptio_result(item, rank, offset, writer.config.tuning.max_block_size)
                offset += result.size_in_bytes
                results.append(result)
            writer._fragment.replicas = own.replicas
            writer.finish(metadata, [results])
            finish_s.append(time.perf_counter() - start)
            if traced:
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
        del plans, holders
        wait_for_merges()  # rank 0's merge, once the last rank's fragment arrived
        merged_path = os.path.join(path, "ckptio.json")
        merged_bytes = os.path.getsize(merged_path)
        fragment_bytes = sum(e.stat().st_size for e in os.scandir(path) if e.name.startswith("ckptio.rank-"))

        def decode() -> None:
            decoded = decode_metadata(read_metadata_bytes(open_store(path)), path).metadata
            _resolve_first_chunks(decoded)

        merged_in = _decode_times(decode)  # the loads after the merge: ckptio.json
        os.remove(merged_path)  # a job that died right after its save: the load merges the fragments
        decoded_in = _decode_times(decode)
    plan_s.sort()
    finish_s.sort()
    return {
        "writer": "ckptio no-coordinator",
        "layout": layout,
        "ranks": ranks,
        "layers": layers,
        "items": items,
        # no coordinator: the slowest rank's own planning and commit
        "global_plan_s": plan_s[-1],
        "finish_s": finish_s[-1],
        "rank_median_s": plan_s[len(plan_s) // 2] + finish_s[len(finish_s) // 2],
        **decoded_in,
        "merged_decode_s": merged_in["decode_s"],
        "merged_decode_min_s": merged_in["decode_min_s"],
        "merged_decode_max_s": merged_in["decode_max_s"],
        "merged_bytes": merged_bytes,
        "metadata_bytes": fragment_bytes,
        "metadata_read_bytes": fragment_bytes,  # the fragments, read once per load that merges them
        "gathered_plan_bytes": 0,
        "rank_peak_bytes": peak,
    }


def _ckptio_planner():
    import ckptio

    return ckptio.SavePlanner()


def _sample(plans: list[SavePlan]) -> list[SavePlan]:
    """A few plans to estimate what the plan gather carries (pickling all of them doubles the memory)."""
    step = max(1, len(plans) // 16)
    return plans[::step]


def parse_points(text: str) -> list[tuple[int, int]]:
    """``"1024:8,8192:1"`` -> [(1024, 8), (8192, 1)]; layers default to all 80."""
    out = []
    for part in text.split(","):
        ranks, _, layers = part.strip().partition(":")
        try:
            point = (int(ranks), int(layers or 80))
        except ValueError:
            usage_error(f"--scale takes RANKS[:LAYERS] separated by commas, e.g. 1024:8,8192:1; got {part!r}")
        if point[0] < TP or point[0] % TP or not 1 <= point[1] <= 80:
            usage_error(f"--scale {part}: ranks must be a multiple of {TP}, layers 1..80")
        out.append(point)
    return out


def run(points: list[tuple[int, int]], progress: Callable[[str], None] = lambda _: None) -> list[dict]:
    """Every layout and writer at every (ranks, layers), each in a fresh process (its peak memory is
    the coordinator's)."""
    import concurrent.futures
    import multiprocessing

    rows = []
    for layout in LAYOUTS:
        for ranks, layers in points:
            for writer in WRITERS:
                progress(f"{writer} {layout} {ranks} ranks x {layers} layers")
                with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    rows.append(pool.submit(_simulate_with_peak, writer, layout, ranks, layers).result())
    return rows


def _simulate_with_peak(writer: str, layout: str, ranks: int, layers: int) -> dict:
    import resource

    if writer == "ckptio no-coordinator":
        row = simulate_without_coordinator(layout, ranks, layers)
    else:
        row = simulate(writer, layout, ranks, layers)
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return row
