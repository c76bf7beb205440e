"""Per-rank bodies of the tiered-checkpoint tests: two "nodes" of two ranks each, each node with its
own fast-tier folder, the durable tier on S3 (moto) or a path."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.format.names import parse_data_file_name
from tests.helpers import combinations, scenarios


def is_full_copy(path: str) -> bool:
    """Whether ``path`` is a node's full copy beside a durable data file (``writing.full_copy_name``: a save
    id one digit longer, ending in ``f``), not the data file itself (whose random id may end in ``f`` too)."""
    parsed = parse_data_file_name(os.path.basename(path))
    return parsed is not None and len(parsed.save_id) == 17


def flip_a_byte(path: str, bit: int = 0x10) -> None:
    """Damage a file as a failing disk would: one bit of its middle byte flipped, its size unchanged."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ bit]))


def as_if_cut_off(durable_step: str, tier: str) -> None:
    """A drained step as if its drain had been cut off before its commit: the durable ``ckptio.json`` gone,
    and the node's note that its drain committed it (which a cut-off drain never writes: ``node_notes``)."""
    import glob

    os.remove(os.path.join(durable_step, "ckptio.json"))
    step = os.path.basename(durable_step)
    for note in glob.glob(os.path.join(tier, "*", step, "ckptio.note-durable-*")):
        os.remove(note)


def node_tier(tier_base: str) -> str:
    """This rank's simulated node (two ranks a node): its fast tier, under ``tier_base``; the rank is
    placed there (``CKPTIO_NODE``, unless the test set ``LOCAL_WORLD_SIZE`` as a launcher would) so that
    replication tells the nodes apart."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if "LOCAL_WORLD_SIZE" not in os.environ:
        os.environ["CKPTIO_NODE"] = f"node{rank // 2}"
    return os.path.join(tier_base, f"node{rank // 2}")


def local_step_folder(run: str, tier_base: str, step: int, options) -> str:
    """This rank's node's fast-tier folder of ``<run>/step-<step>``."""
    from ckptio.tiers.paths import local_step_path

    return local_step_path(node_tier(tier_base), f"{run}/step-{step}", options)


def state(mesh_shape, step: int, empty: bool = False) -> dict:
    value = scenarios.make_state(scenarios.make_mesh(mesh_shape), empty=empty)
    value["marker"] = torch.tensor([0 if empty else step], dtype=torch.int64)
    return value


def problems(value: dict, step: int) -> list[str]:
    return scenarios.mismatches(value) + ([] if int(value["marker"]) == step else [f"marker {int(value['marker'])}"])


def tiered_writer(run: str, step: int, tier_base: str, options, config: dict) -> ckptio.Writer:
    """A Writer of ``<run>/step-<step>`` with this rank's node tier."""
    return ckptio.Writer(
        f"{run}/step-{step}", ckptio.WriterConfig(local_tier=node_tier(tier_base), **config), storage_options=options
    )


def save_steps(
    run: str, tier_base: str, mesh_shape, steps, options, config: dict | None = None, collectives: bool = True
) -> int:
    for step in steps:
        writer = tiered_writer(run, step, tier_base, options, config or {})
        dcp.save(state(mesh_shape, step), storage_writer=writer, use_collectives=collectives)
    ckptio.wait_for_uploads()
    return dist.get_rank()


def save_with_a_stalled_drain(
    run: str, tier_base: str, mesh_shape, options, collectives: bool = True, config: dict | None = None
) -> str:
    """Save step 1 (drained), then step 2 with a drain that cannot finish (as if the job died during it),
    both with ``config``; what ``wait_for_uploads`` raised after step 2."""
    save_steps(run, tier_base, mesh_shape, [1], options, config, collectives)
    stalled = {
        **(config or {}),
        "drain_bandwidth": 1,
        "tuning": {**(config or {}).get("tuning", {}), "drain_timeout_s": 0.5},
    }
    writer = tiered_writer(run, 2, tier_base, options, stalled)
    dcp.save(state(mesh_shape, 2), storage_writer=writer, use_collectives=collectives)
    try:
        ckptio.wait_for_uploads()
    except ckptio.DrainError as exc:
        return str(exc)
    return "drained"


def save_then_die(run: str, tier_base: str, mesh_shape, options, victim: int, config: dict) -> str:
    """Save step 1 (drained), then step 2, after which rank ``victim`` is killed (SIGKILL) as its drain
    starts; the other ranks' drains time out. Returns what ``wait_for_uploads`` raised."""
    save_steps(run, tier_base, mesh_shape, [1], options, {"mode": config.get("mode", "all_ranks")})
    dcp.save(state(mesh_shape, 2), storage_writer=tiered_writer(run, 2, tier_base, options, config))
    return killed_or_drained(victim)


def killed_or_drained(*victims: int) -> str:
    """Ranks ``victims`` killed (SIGKILL) as their drains start; on the others, what ``wait_for_uploads``
    raised."""
    if dist.get_rank() in victims:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        ckptio.wait_for_uploads()
    except ckptio.DrainError as exc:
        return str(exc)
    return "drained"


def restart(run: str, tier_base: str, mesh_shape, options, finish_drain: bool = True, changing=False) -> tuple:
    """What a restarted job does: agree on the newest step, load it from the nearest tier. ``changing``:
    the run saved ``combinations.state`` (``save_incremental_then_die``)."""
    url = ckptio.latest(run, local_tier=node_tier(tier_base), storage_options=options)
    step = int(url.rsplit("-", 1)[1])
    value = _empty(mesh_shape, step, changing)
    reader = ckptio.Reader(url, storage_options=options, local_tier=node_tier(tier_base))
    dcp.load(value, storage_reader=reader)
    if finish_drain:
        ckptio.wait_for_uploads()
    return url, _problems(value, step, changing), reader.bytes_read


def load_durable(url: str, mesh_shape, options, step: int, changing=False) -> list[str]:
    """A plain ``dcp.load`` of the durable copy alone."""
    value = _empty(mesh_shape, step, changing)
    dcp.load(value, storage_reader=ckptio.Reader(url, storage_options=options))
    return _problems(value, step, changing)


def _empty(mesh_shape, step: int, changing: bool) -> dict:
    return combinations.state(_ROW, step, zeros=True) if changing else state(mesh_shape, 0, empty=True)


def _problems(value: dict, step: int, changing: bool) -> list[str]:
    return combinations.problems(value, step, _ROW) if changing else problems(value, step)


_ROW = {"group": "default"}  # combinations.state on the 2x2 mesh


def save_incremental_then_die(run: str, tier_base: str, options, victim: int) -> str:
    """Tiered incremental saves of a state whose moments change (``combinations.state``): step 1 drained,
    then step 2, whose drain at 500 B/s cannot finish in 3 s, and rank ``victim`` killed (SIGKILL) as it
    starts; what ``wait_for_uploads`` raised on the others."""
    config = {"incremental_from": "previous", "tuning": {"max_block_size": 1024, "inline_limit": 0}}
    config["differing_objects"] = "keep_per_rank"  # its per-rank value
    dcp.save(combinations.state(_ROW, 1), storage_writer=tiered_writer(run, 1, tier_base, options, config))
    ckptio.wait_for_uploads()
    slow = {**config, "drain_bandwidth": 500, "tuning": {**config["tuning"], "drain_timeout_s": 3}}
    dcp.save(combinations.state(_ROW, 2), storage_writer=tiered_writer(run, 2, tier_base, options, slow))
    return killed_or_drained(victim)


def killed_during_incremental_save(run: str, tier_base: str, options, victim: int) -> str:
    """Tiered incremental step 1 (drained), then step 2 with rank ``victim`` killed (SIGKILL) while it
    writes its items to the fast tier; what the save raised on the others."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class DiesWhileWriting(DefaultSavePlanner):
        def resolve_data(self, write_item):
            if dist.get_rank() == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().resolve_data(write_item)

    config = {"incremental_from": "previous", "tuning": {"max_block_size": 1024, "inline_limit": 0}}
    config["differing_objects"] = "keep_per_rank"
    dcp.save(combinations.state(_ROW, 1), storage_writer=tiered_writer(run, 1, tier_base, options, config))
    ckptio.wait_for_uploads()
    writer = tiered_writer(run, 2, tier_base, options, config)
    try:
        dcp.save(combinations.state(_ROW, 2), storage_writer=writer, planner=DiesWhileWriting())
    except Exception as exc:  # noqa: BLE001 - torch's CheckpointException or gloo's error
        return type(exc).__name__
    return "saved"


def settling(step: int, empty: bool = False) -> dict:
    """A state sharded over every rank: ``frozen`` never changes, ``moving`` changes every step, and ``settled``
    appears at step 2 and then stays (step 3 references step 2's own bytes)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = scenarios.make_mesh((dist.get_world_size(),))
    shapes = {"frozen": ((1024, 1024), 0), "moving": ((64, 1024), step)} | (
        {"settled": ((512, 1024), 2)} if step >= 2 else {}
    )
    value = {}
    for key, (shape, seed) in shapes.items():
        full = torch.zeros(shape) if empty else torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        value[key] = distribute_tensor(full, mesh, [Shard(0)])
    value["marker"] = torch.tensor([-1 if empty else step])
    return value


def save_while_draining(run: str, tier_base: str, options, steps: int, damaged_rank: int | None = None) -> str:
    """Steps 1..``steps`` of ``settling``, each saved while the one before it drains (1 MiB/s a rank); rank
    ``damaged_rank``'s node copy of step 2 damaged before its upload; what ``wait_for_uploads`` raised."""
    tuning = {"inline_limit": 0, "drain_timeout_s": 60}
    config = {"incremental_from": "previous", "drain_bandwidth": 1 << 20, "tuning": tuning}
    for step in range(1, steps + 1):
        dcp.save(settling(step), storage_writer=tiered_writer(run, step, tier_base, options, config))
        if step == 2 and dist.get_rank() == damaged_rank:
            import glob

            folder = local_step_folder(run, tier_base, 2, options)
            (own,) = [p for p in glob.glob(f"{folder}/data-*-r{damaged_rank:05d}.ckio") if not is_full_copy(p)]
            flip_a_byte(own)
    pending = ckptio.uploads_pending()
    try:
        ckptio.wait_for_uploads()
    except ckptio.DrainError as exc:
        return f"{pending} {exc}"
    return f"{pending} drained"


def load_settling(url: str, options, step: int) -> bool:
    value = settling(step, empty=True)
    dcp.load(value, storage_reader=ckptio.Reader(url, storage_options=options))
    want = settling(step)
    return int(value["marker"]) == step and all(
        torch.equal(value[k].full_tensor(), want[k].full_tensor()) for k in want if k != "marker"
    )


def save_while_draining_then_die(run: str, tier_base: str, options, steps: int) -> None:
    """Steps 1..``steps`` of ``settling``, each saved while the one before drains (64 KiB/s a rank: none has
    finished), then the job killed (SIGKILL, every rank)."""
    config = {"incremental_from": "previous", "drain_bandwidth": 64 << 10, "tuning": {"inline_limit": 0}}
    for step in range(1, steps + 1):
        dcp.save(settling(step), storage_writer=tiered_writer(run, step, tier_base, options, config))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def restart_settling(run: str, tier_base: str, options) -> tuple:
    """A restart of ``save_while_draining_then_die``'s job: the newest step, loaded from the nodes, its drain
    finished; whether the load was exact and what it read from the durable tier."""
    url = ckptio.latest(run, local_tier=node_tier(tier_base), storage_options=options)
    step = int(url.rsplit("-", 1)[1])
    value = settling(step, empty=True)
    reader = ckptio.Reader(url, storage_options=options, local_tier=node_tier(tier_base))
    dcp.load(value, storage_reader=reader)
    ckptio.wait_for_uploads()
    want = settling(step)
    exact = int(value["marker"]) == step and all(
        torch.equal(value[k].full_tensor(), want[k].full_tensor()) for k in want if k != "marker"
    )
    return url, exact, reader.bytes_read["durable"]
