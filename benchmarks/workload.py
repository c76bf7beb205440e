"""A deterministic HSDP training state of a chosen size: model, Adam-like moments, per-rank objects.

Rows of every tensor are generated in fixed blocks seeded by (name, block), so any rank can
rebuild any shard of any layout exactly, which is how loads are verified after resharding.
"""

from __future__ import annotations

import io
import zlib
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

COLS = 1024
ROW_BLOCK = 64
# Relative layer heights: unequal, some not divisible by the shard count, like a real model.
LAYER_SHAPE = (3, 5, 2, 7, 4, 6, 1, 8)
TRAIN_CONFIG = {"lr": 3e-4, "betas": [0.9, 0.95], "run": "bench"}
#: What the tensors hold: normal fp32 values; bf16-precision values kept in fp32 (half of every
#: value's bytes are zero); bf16 weights beside fp32 Adam moments, as mixed-precision training
#: keeps them; uniformly random bytes (incompressible).
#: ``transformer``: adam-moments' values in a transformer's layout (issue 50's outside harness: hidden
#: 512, bf16 embedding, attention and MLP matrices of several shapes, fp32 norms and an fp32 position
#: table of uneven height, a step tensor per parameter: ~200 tensors of 2 KiB to 8 MiB, not 24 large ones).
DATA_KINDS = ("randn", "bf16-in-fp32", "bf16-weights", "adam-moments", "random-bytes", "transformer")
#: Kinds whose weights are bf16 (the moments stay fp32).
BF16_WEIGHTS = ("bf16-weights", "adam-moments", "transformer")
#: Kinds whose values are a trained state's (``_adam_values``).
ADAM_VALUES = ("adam-moments", "transformer")
HIDDEN = 512


def data_kind(data: str | bool) -> str:
    """``data`` as one of DATA_KINDS (``True``/``False``: the older ``compressible`` flag)."""
    kind = {True: "bf16-in-fp32", False: "randn"}.get(data, data) if isinstance(data, bool) else data
    if kind not in DATA_KINDS:
        raise ValueError(f"unknown data kind {data!r}; choose from {DATA_KINDS}")
    return kind


@dataclass(frozen=True)
class Spec:
    name: str
    rows: int
    dtype: torch.dtype
    cols: int = COLS


def tensor_specs(size_bytes: int, data: str | bool = "randn") -> list[Spec]:
    """Parameters (fp32, or bf16 for ``BF16_WEIGHTS``) plus exp_avg and exp_avg_sq of each (fp32),
    about ``size_bytes`` in all."""
    if data_kind(data) == "transformer":
        return transformer_specs(size_bytes)
    weights = torch.bfloat16 if data_kind(data) in BF16_WEIGHTS else torch.float32
    per_tensor_set = size_bytes / (weights.itemsize + 8) / COLS  # rows across all layers
    unit = per_tensor_set / sum(LAYER_SHAPE)
    specs = []
    for i, weight in enumerate(LAYER_SHAPE):
        rows = max(1, int(unit * weight)) + (i % 3)  # +0/1/2 keeps some heights uneven
        specs.append(Spec(f"model.layers.{i}.weight", rows, weights))
        specs.append(Spec(f"optim.state.layers.{i}.weight.exp_avg", rows, torch.float32))
        specs.append(Spec(f"optim.state.layers.{i}.weight.exp_avg_sq", rows, torch.float32))
    return specs


def transformer_specs(size_bytes: int) -> list[Spec]:
    """A transformer of hidden size ``HIDDEN`` with as many layers as fit ``size_bytes`` (7 at ~256 MiB),
    each parameter with its two AdamW moments (fp32): an 8,192-token bf16 embedding, a 1,023-row fp32
    position table (uneven across shards), per layer qkv (3H x H), out (H x H), MLP up (4H x H) and down
    (H x 4H) in bf16, a qkv bias and two norms, then a final norm. Vectors are 1-row matrices."""
    h = HIDDEN
    layer = [("attn.qkv.weight", 3 * h, h, torch.bfloat16), ("attn.out.weight", h, h, torch.bfloat16)]
    layer += [("mlp.up.weight", 4 * h, h, torch.bfloat16), ("mlp.down.weight", h, 4 * h, torch.bfloat16)]
    layer += [("attn.qkv.bias", 1, 3 * h, torch.bfloat16), ("norm1.weight", 1, h, torch.float32)]
    layer += [("norm2.weight", 1, h, torch.float32)]
    per_layer = sum(rows * cols * (dtype.itemsize + 8) for _, rows, cols, dtype in layer)
    layers = max(1, round((size_bytes - 8192 * h * 10 - 1023 * h * 12) / per_layer))
    params = [("embed.weight", 8192, h, torch.bfloat16), ("pos_embed", 1023, h, torch.float32)]
    params += [(f"layers.{i}.{name}", rows, cols, dtype) for i in range(layers) for name, rows, cols, dtype in layer]
    params += [("final_norm.weight", 1, h, torch.float32)]
    specs = []
    for name, rows, cols, dtype in params:
        specs.append(Spec(f"model.{name}", rows, dtype, cols))
        specs.append(Spec(f"optim.state.{name}.exp_avg", rows, torch.float32, cols))
        specs.append(Spec(f"optim.state.{name}.exp_avg_sq", rows, torch.float32, cols))
    return specs


def rows_of(spec: Spec, start: int, stop: int, data: str | bool) -> torch.Tensor:
    """Rows ``start:stop`` of the global tensor ``spec``, identical wherever they are built."""
    kind = data_kind(data)
    cols = spec.cols
    out = torch.empty((max(stop - start, 0), cols), dtype=spec.dtype)
    seed = zlib.crc32(spec.name.encode())
    for block in range(start // ROW_BLOCK, -(-stop // ROW_BLOCK)):
        b0, b1 = block * ROW_BLOCK, min((block + 1) * ROW_BLOCK, spec.rows)
        gen = torch.Generator().manual_seed(seed * 100_003 + block)
        if kind == "random-bytes":
            values = torch.randint(0, 256, (b1 - b0, cols * spec.dtype.itemsize), generator=gen, dtype=torch.uint8)
            values = values.view(spec.dtype)
        elif kind in ADAM_VALUES:
            values = _adam_values(spec.name, torch.randn((b1 - b0, cols), generator=gen)).to(spec.dtype)
        else:
            values = torch.randn((b1 - b0, cols), generator=gen).to(spec.dtype)
        if kind == "bf16-in-fp32":  # bf16 precision stored in fp32: half of every value's bytes are zero
            values = values.bfloat16().float()
        lo, hi = max(b0, start), min(b1, stop)
        out[lo - start : hi - start] = values[lo - b0 : hi - b0]
    return out


def _adam_values(name: str, normal: torch.Tensor) -> torch.Tensor:
    """What a trained model's tensors hold: weights ~0.02 N(0, 1) (bf16), AdamW's first moment ~1e-3
    N(0, 1) and second moment its square (fp32, spanning many exponents)."""
    if name.endswith(".exp_avg"):
        return normal * 1e-3
    if name.endswith(".exp_avg_sq"):
        return (normal * 1e-3) ** 2
    return normal * 0.02


def step_keys(specs: list[Spec], data: str | bool) -> list[str]:
    """The per-parameter ``step`` tensors an ``adam-moments`` state holds (AdamW keeps one per parameter)."""
    if data_kind(data) not in ADAM_VALUES:
        return []
    return [
        s.name.removeprefix("optim.state.").removesuffix(".exp_avg") + ".step"
        for s in specs
        if s.name.endswith(".exp_avg")
    ]


def shard_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """DTensor's ``Shard(0)`` split (torch.chunk semantics: ceil-sized, trailing shards may be short or empty)."""
    chunk = -(-rows // shards)
    return min(index * chunk, rows), min((index + 1) * chunk, rows)


def build_state(mesh, specs: list[Spec], data: str | bool, rank: int, empty: bool = False) -> dict:
    """The rank's share of the state, on the mesh's device type (CUDA tensors go to the current device)."""
    device = "cuda" if mesh.device_type == "cuda" else "cpu"
    shard_index = mesh.get_local_rank("shard")
    shards = mesh.size(mesh.mesh_dim_names.index("shard"))
    state: dict = {"model": {}, "optim": {"state": {}}}
    for spec in specs:
        a, b = shard_rows(spec.rows, shards, shard_index)
        local = torch.zeros((b - a, spec.cols), dtype=spec.dtype) if empty else rows_of(spec, a, b, data)
        local = local.to(device)
        shape, stride = torch.Size((spec.rows, spec.cols)), (spec.cols, 1)
        value = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False, shape=shape, stride=stride)
        head, rest = spec.name.split(".", 1)
        (state["model"] if head == "model" else state["optim"]["state"])[rest.removeprefix("state.")] = value
    state["optim"]["step"] = torch.tensor(0.0 if empty else 1000.0)
    for key in step_keys(specs, data):
        state["optim"]["state"][key] = torch.tensor(0.0 if empty else 1000.0)
    config, loader = dict(TRAIN_CONFIG), {"epoch": 3, "position": 17 + 1000 * rank}
    state["train_config"] = dict.fromkeys(config) if empty else config
    state[f"dataloader.rank{rank}"] = dict.fromkeys(loader) if empty else loader
    return state


def check_state(state: dict, specs: list[Spec], data: str | bool, rank: int) -> list[str]:
    """Keys whose loaded local values differ bitwise from what was saved."""
    bad = []
    for spec in specs:
        head, rest = spec.name.split(".", 1)
        value = (state["model"] if head == "model" else state["optim"]["state"])[rest.removeprefix("state.")]
        mesh = value.device_mesh
        a, b = shard_rows(spec.rows, mesh.size(mesh.mesh_dim_names.index("shard")), mesh.get_local_rank("shard"))
        if not torch.equal(value.to_local().cpu().view(torch.uint8), rows_of(spec, a, b, data).view(torch.uint8)):
            bad.append(spec.name)
    if state["optim"]["step"].item() != 1000.0:
        bad.append("optim.step")
    bad += [f"optim.state.{key}" for key in step_keys(specs, data) if state["optim"]["state"][key].item() != 1000.0]
    if state["train_config"] != TRAIN_CONFIG:
        bad.append("train_config")
    if state[f"dataloader.rank{rank}"] != {"epoch": 3, "position": 17 + 1000 * rank}:
        bad.append(f"dataloader.rank{rank}")
    return bad


def byte_counts(specs: list[Spec], mesh_shape: tuple[int, int], data: str | bool = "randn") -> dict[str, int]:
    """Logical bytes (as all ranks hold them, replicas counted) and unique bytes of the state."""
    replicas, shards = mesh_shape
    world = replicas * shards
    scalars = 1 + len(step_keys(specs, data))  # optim.step, and the per-parameter steps
    unique_tensors = sum(s.rows * s.cols * s.dtype.itemsize for s in specs) + 4 * scalars
    # torch's planner flattens dicts: each value is pickled on its own
    shared = sum(len(_pickled(v)) for v in TRAIN_CONFIG.values())
    per_rank = sum(len(_pickled(3)) + len(_pickled(17 + 1000 * r)) for r in range(world))
    return {
        "logical_bytes": unique_tensors * replicas + 4 * scalars * (world - replicas) + shared * world + per_rank,
        "unique_bytes": unique_tensors + shared + per_rank,
    }


def _pickled(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "KIB": 1 << 10, "KB": 1000, "MIB": 1 << 20, "MB": 10**6, "GIB": 1 << 30, "GB": 10**9}
    t = text.strip().upper()
    number = t.rstrip("KMGIB")
    return int(float(number) * units[t[len(number) :]])


def held_tensor_bytes(state) -> int:
    """Bytes of the tensors this rank holds (its DTensors' local shards)."""
    if isinstance(state, dict):
        return sum(held_tensor_bytes(v) for v in state.values())
    if isinstance(state, DTensor):
        state = state.to_local()
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    return 0
