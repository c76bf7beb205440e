"""Small real models under real parallel layouts (FSDP2, HSDP, TP, FSDP2+TP), for resharding tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import ckptio

IN, HIDDEN = 16, 38  # 38 splits unevenly over 4 shards


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(IN, HIDDEN)
        self.down = nn.Linear(HIDDEN, IN)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([MLP(), MLP()])
        self.head = nn.Linear(IN, 5)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build(layout: str, seed: int = 0):
    """A model under ``layout`` (see ``build_model``) and its Adam optimizer."""
    model = build_model(layout, seed)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def build_model(layout: str, seed: int = 0) -> nn.Module:
    """``layout``: "single", "fsdp:N", "hsdp:RxS", "tp:N" or "dp_tp:DxT" (FSDP2 over dp, TP inside)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = Net()
    kind, _, shape = layout.partition(":")
    dims = tuple(int(x) for x in shape.split("x")) if shape else ()
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("shard",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "hsdp":
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind in ("tp", "dp_tp"):
        names = ("tp",) if kind == "tp" else ("dp", "tp")
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if kind == "dp_tp":
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
    elif kind != "single":
        raise ValueError(layout)
    return model


def train_step(model, optimizer) -> None:
    torch.manual_seed(1234)
    model(torch.randn(8, IN)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model, optimizer) -> dict:
    """Model and optimizer state as full CPU tensors (on rank 0 when distributed)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=dist.is_initialized())
    msd, osd = get_state_dict(model, optimizer, options=options)
    return {"model": msd, "optim": osd}


def save_trained(layout: str, url: str, mode: str, reference: str) -> None:
    model, optimizer = build(layout)
    train_step(model, optimizer)
    msd, osd = get_state_dict(model, optimizer)
    ckptio.save({"model": msd, "optim": osd}, url, ckptio.WriterConfig(mode=mode))
    full = full_state(model, optimizer)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(full, reference)


def load_into(layouts: list[str], urls: list[str], reference: str, reader: dict | None = None) -> list[str]:
    """Load every checkpoint into every layout (fresh, differently initialised models); return
    mismatches. ``reader``: options for ``ckptio.load``."""
    expected = torch.load(reference, weights_only=True)
    bad = []
    for layout in layouts:
        for url in urls:
            model, optimizer = build(layout, seed=99)
            msd, osd = get_state_dict(model, optimizer)
            ckptio.load({"model": msd, "optim": osd}, url, **(reader or {}))
            set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
            got = full_state(model, optimizer)
            if not dist.is_initialized() or dist.get_rank() == 0:
                bad += [f"{layout} <- {url}: {d}" for d in differences(expected, got)]
    return bad


def differences(expected, got, path: str = "") -> list[str]:
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(expected) != set(got):
            return [f"{path}: keys {sorted(map(str, expected))} != {sorted(map(str, got or {}))}"]
        return [d for k in expected for d in differences(expected[k], got[k], f"{path}.{k}")]
    if isinstance(expected, torch.Tensor):
        ok = (
            isinstance(got, torch.Tensor)
            and got.dtype == expected.dtype
            and got.shape == expected.shape
            and torch.equal(
                got.contiguous().reshape(-1).view(torch.uint8), expected.contiguous().reshape(-1).view(torch.uint8)
            )
        )
        return [] if ok else [path]
    return [] if expected == got else [f"{path}: {expected!r} != {got!r}"]
