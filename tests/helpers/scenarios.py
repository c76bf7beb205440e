"""Deterministic training-like states and the per-rank bodies the distributed tests spawn."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckptio

# name -> (global shape, dtype); dims 37 and 50 split unevenly across 2 or 4 shards.
TENSORS = {
    "model.layers.0.weight": ((64, 48), torch.float32),
    "model.layers.0.bias": ((37,), torch.bfloat16),
    "model.embed.weight": ((50, 24), torch.bfloat16),
    "optim.state.layers.0.weight.exp_avg": ((64, 48), torch.float32),
    "optim.state.layers.0.weight.exp_avg_sq": ((64, 48), torch.float32),
    "optim.state.embed.weight.exp_avg": ((50, 24), torch.float32),
}
OBJECTS = {"extra": {"lr": 0.01, "betas": [0.9, 0.999], "name": "run-7"}, "blob": b"\x00\x01ckptio" * 10}
STEP = torch.tensor(100.0)
#: Shared reads in several rounds of a small state.
SMALL_ROUNDS = ckptio.Tuning(dedup_round_bytes=20_000)


def global_tensor(name: str) -> torch.Tensor:
    shape, dtype = TENSORS[name]
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen).to(dtype)


def logical_tensor_bytes() -> int:
    return sum(global_tensor(n).numel() * global_tensor(n).element_size() for n in TENSORS) + STEP.element_size()


def make_mesh(mesh_shape):
    if mesh_shape is None:
        return None
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    return init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)


def make_state(mesh, empty: bool = False) -> dict:
    state: dict = {"model": {}, "optim": {}}
    for name in TENSORS:
        value = torch.zeros_like(global_tensor(name)) if empty else global_tensor(name)
        if mesh is not None:
            placements = [Replicate(), Shard(0)] if mesh.ndim == 2 else [Shard(0)]
            value = distribute_tensor(value, mesh, placements)
        _put(state, name, value)
    state["optim"]["step"] = torch.zeros(()) if empty else STEP.clone()
    for key, value in OBJECTS.items():
        state[key] = {k: None for k in value} if (empty and isinstance(value, dict)) else (None if empty else value)
    return state


def _put(state: dict, dotted: str, value) -> None:
    head, _, rest = dotted.partition(".")
    if head in ("model", "optim") and head in state:
        state[head][rest] = value
    else:
        state[dotted] = value


def mismatches(state: dict) -> list[str]:
    """Names whose loaded value differs (bitwise) from what was saved."""
    bad = []
    for name in TENSORS:
        head, _, rest = name.partition(".")
        value = state[head][rest]
        full = value.full_tensor() if isinstance(value, DTensor) else value
        expected = global_tensor(name)
        if full.dtype != expected.dtype or not torch.equal(full.view(torch.uint8), expected.view(torch.uint8)):
            bad.append(name)
    if not torch.equal(state["optim"]["step"], STEP):
        bad.append("optim.step")
    for key, value in OBJECTS.items():
        if state[key] != value:
            bad.append(key)
    return bad


def save(url: str, mesh_shape, mode: str, storage_options=None, **config) -> int:
    state = make_state(make_mesh(mesh_shape))
    writer = ckptio.Writer(url, ckptio.WriterConfig(mode=mode, **config), storage_options=storage_options)
    dcp.save(state, storage_writer=writer)
    return dist.get_rank() if dist.is_initialized() else 0


def load(url: str, mesh_shape, storage_options=None, via_checkpoint_id: bool = False, **reader) -> list[str]:
    state = make_state(make_mesh(mesh_shape), empty=True)
    if via_checkpoint_id:
        dcp.load(state, storage_reader=ckptio.Reader(storage_options=storage_options, **reader), checkpoint_id=url)
    else:
        dcp.load(state, storage_reader=ckptio.Reader(url, storage_options=storage_options, **reader))
    return mismatches(state)


def load_with_ckptio(url: str, mesh_shape, storage_options=None) -> list[str]:
    state = make_state(make_mesh(mesh_shape), empty=True)
    ckptio.load(state, url, storage_options=storage_options)
    return mismatches(state)


def load_in_pairs(url: str, storage_options=None) -> list[str]:
    """Ranks {0, 1} and {2, 3} each load the whole state, with dcp.load over their pair."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both, as torch requires
    state = make_state(None, empty=True)
    reader = ckptio.Reader(url, storage_options=storage_options)
    dcp.load(state, storage_reader=reader, process_group=pairs[dist.get_rank() // 2])
    return mismatches(state)


def load_shared(url: str, mesh_shape, storage_options, dedup_reads) -> list[str]:
    """``load`` with ``Reader(dedup_reads=...)``; a small round budget, so several rounds run."""
    return load(url, mesh_shape, storage_options, dedup_reads=dedup_reads, tuning=SMALL_ROUNDS)


def save_each_mode(base: str, mesh_shape, storage_options=None, via_checkpoint_id: bool = False) -> None:
    """Save the same state once per mode under ``base/<mode>``."""
    for mode in ckptio.config.MODES:
        if via_checkpoint_id:
            writer = ckptio.Writer(config=ckptio.WriterConfig(mode=mode), storage_options=storage_options)
            dcp.save(make_state(make_mesh(mesh_shape)), storage_writer=writer, checkpoint_id=f"{base}/{mode}")
        else:
            save(f"{base}/{mode}", mesh_shape, mode, storage_options)


def load_each_mode(base: str, mesh_shape, storage_options=None, via_checkpoint_id: bool = False) -> dict:
    return {
        mode: load(f"{base}/{mode}", mesh_shape, storage_options, via_checkpoint_id) for mode in ckptio.config.MODES
    }


def save_and_load_columns(url: str, compression, block_size: int) -> list[str]:
    """Save rows-sharded on a 1-D mesh, load columns-sharded: every read is a strided sub-box."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    state = {n: distribute_tensor(global_tensor(n), mesh, [Shard(0)]) for n in TENSORS}
    config = ckptio.WriterConfig(compression=compression, tuning=ckptio.Tuning(max_block_size=block_size))
    dcp.save(state, storage_writer=ckptio.Writer(url, config))
    loaded = {
        n: distribute_tensor(torch.zeros_like(global_tensor(n)), mesh, [Shard(len(TENSORS[n][0]) - 1)]) for n in TENSORS
    }
    dcp.load(loaded, storage_reader=ckptio.Reader(url))
    return [
        n
        for n in TENSORS
        if not torch.equal(loaded[n].full_tensor().view(torch.uint8), global_tensor(n).view(torch.uint8))
    ]


# --- larger HSDP states, built by the benchmark's workload (multipart-sized objects) -------------
def bench_save(url: str, size: int, mesh_shape, mode: str, storage_options=None, **config) -> None:
    from ckptio.bench import workload
    from ckptio.bench.runner import mesh_of

    state = workload.build_state(mesh_of(tuple(mesh_shape), "cpu"), workload.tensor_specs(size), False, dist.get_rank())
    ckptio.save(state, url, ckptio.WriterConfig(mode=mode, **config), storage_options=storage_options)


def bench_load(url: str, size: int, mesh_shape, storage_options=None, **reader) -> tuple[list[str], int]:
    """Load on ``mesh_shape``; return (mismatching keys, tensor bytes this rank's plan needs)."""
    from ckptio.bench import workload
    from ckptio.bench.runner import mesh_of

    specs = workload.tensor_specs(size)
    state = workload.build_state(mesh_of(tuple(mesh_shape), "cpu"), specs, False, dist.get_rank(), empty=True)
    ckptio.load(state, url, storage_options=storage_options, **reader)
    needed = sum(v.to_local().numel() * v.to_local().element_size() for v in _dtensors(state))
    return workload.check_state(state, specs, False, dist.get_rank()), needed


def bench_load_growth(url: str, size: int, mesh_shape, storage_options=None, **reader) -> tuple[list[str], int, int]:
    """``bench_load``, and how far this rank's resident memory rose above where it stood when the
    load began (the kernel's high-water mark, reset first): the load's transient memory."""
    from ckptio.bench import workload
    from ckptio.bench.runner import mesh_of

    specs = workload.tensor_specs(size)
    state = workload.build_state(mesh_of(tuple(mesh_shape), "cpu"), specs, False, dist.get_rank(), empty=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    before = _status_bytes("VmRSS")
    ckptio.load(state, url, storage_options=storage_options, **reader)
    growth = _status_bytes("VmHWM") - before
    needed = sum(v.to_local().numel() * v.to_local().element_size() for v in _dtensors(state))
    return workload.check_state(state, specs, False, dist.get_rank()), growth, needed


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _dtensors(state):
    for value in state.values():
        if isinstance(value, dict):
            yield from _dtensors(value)
        elif isinstance(value, DTensor):
            yield value


def expect_save_failure(url: str, size: int, mesh_shape, storage_options, **config) -> str:
    """Save must raise a ckptio error on this rank; return its message."""
    try:
        bench_save(url, size, mesh_shape, "all_ranks", storage_options, **config)
    except ckptio.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("the save succeeded although the store kept failing")


class DieWhenPickled:
    """Kills its process the moment a checkpoint writer serializes it: a rank dying mid-save."""

    def __reduce__(self):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def save_then_die_mid_save(previous_url: str, url: str) -> tuple[float, str]:
    """Both ranks commit ``previous_url``; then rank 1 dies while saving ``url``.
    Rank 0 returns (seconds until its save failed, the error)."""
    import time

    save(previous_url, (1, 2), "all_ranks")
    state = make_state(make_mesh((1, 2)))
    if dist.get_rank() == 1:
        state["dies_here"] = DieWhenPickled()
    start = time.monotonic()
    try:
        ckptio.save(state, url)
    except BaseException as exc:  # noqa: BLE001 - whatever the survivor sees is the result
        return time.monotonic() - start, f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    return time.monotonic() - start, "no error"


def load_where_only_rank_1_is_wrong(url: str) -> tuple[float, str]:
    """Rank 1 points at a path that does not exist; every rank must fail promptly."""
    import time

    start = time.monotonic()
    target = url if dist.get_rank() == 0 else url + "-typo"
    try:
        ckptio.load(make_state(make_mesh((1, 2)), empty=True), target)
    except ckptio.CheckpointError as exc:
        return time.monotonic() - start, f"{type(exc).__name__}: {exc}"
    return time.monotonic() - start, "no error"


def load_shared_error(url: str, mesh_shape) -> str:
    """A shared-reads load that must fail: this rank's ckptio error as 'Class: message'."""
    try:
        load(url, mesh_shape, None, dedup_reads=True, tuning=SMALL_ROUNDS)
    except ckptio.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    except BaseException as exc:  # noqa: BLE001 - dcp.load's wrapper: unwrap to the ckptio error
        from torch.distributed.checkpoint import CheckpointException

        if isinstance(exc, CheckpointException):
            error = ckptio.unwrap(exc)
            return f"{type(error).__name__}: {error}"
        raise
    return "loaded"
