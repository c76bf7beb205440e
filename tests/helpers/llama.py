"""A tiny Llama-shaped model (Hugging Face names, bf16) under HSDP and FSDP2+TP, for the export tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import ckptio

HIDDEN, FFN, VOCAB, LAYERS = 64, 96, 100, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = Attention(), MLP()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)


class CausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Body()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)


def build(layout: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
    """``layout``: "single", "fsdp:N", "tp:N", "hsdp:RxS" or "dp_tp:DxT" (FSDP2 over dp, TP inside:
    strided shards). Parameters are drawn from ``seed``, in bf16, then cast to ``dtype``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = CausalLM().to(torch.bfloat16)
    for p in model.parameters():  # non-trivial norms too
        nn.init.normal_(p)
    model = model.to(dtype)
    kind, _, shape = layout.partition(":")
    dims = tuple(int(x) for x in shape.split("x")) if shape else ()
    plan = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel()}
    plan |= {"mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("shard",))
    elif kind == "hsdp":
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("replicate", "shard"))
    elif kind in ("tp", "dp_tp"):
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("tp",) if kind == "tp" else ("dp", "tp"))
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
        if kind == "tp":
            return model
        mesh = mesh["dp"]
    elif kind == "single":
        return model
    else:
        raise ValueError(layout)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def save(layout: str, url: str) -> dict | None:
    """Save {"model": ..., "step": ...} with ckptio; return the full model state on rank 0."""
    model = build(layout)
    ckptio.save({"model": get_model_state_dict(model), "step": 7}, url)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return full if dist.get_rank() == 0 else None


def export(url: str, out: str, max_shard_size: int) -> list[str]:
    return ckptio.export_safetensors(url, out, keys="model.", max_shard_size=max_shard_size)
