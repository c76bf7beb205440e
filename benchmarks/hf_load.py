"""Loading Hugging Face safetensors weights on N ranks: ``ckptio.HFReader`` beside torch's
``HuggingFaceStorageReader`` (a local folder; same state, same run) and from S3 (moto on loopback).

    python -m ckptio.bench.hf_load [--size 256MiB] [--repeats 5] [--ranks 4] [--json FILE]

The weights: a Llama-shaped bf16 model (hidden 1024, FFN 3584, vocab 32000, as many layers as
``--size`` holds), written by the ``safetensors`` library in shards of at most 100 MB plus
``model.safetensors.index.json``. Layouts: FSDP (every weight by rows), TP (q/k/v/gate/up and the
embeddings by rows, o/down by columns, norms replicated) and HSDP 2 x N/2. Both readers load the
same state with plain ``dcp.load``; every ckptio load is compared with torch's, bit for bit.

Per load: seconds of the slowest rank (median and min-max over the repeats); the bytes the ranks
need (their local shards); the bytes read: read system calls of the ranks (``/proc/self/io``
rchar; torch's reader maps the files, so it has none) or the S3 GET bytes served.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ckptio.hf.export import parse_size

from . import counting
from .launch import launch
from .s3server import create_bucket, local_s3_server, use_test_credentials

HIDDEN, FFN, VOCAB = 1024, 3584, 32000
SHARD_BYTES = 100_000_000
ROWWISE = ("o_proj", "down_proj")  # TP shards these by columns (dim 1)


def shapes(size: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of a Llama with as many layers as ``size`` bytes of bf16 hold."""
    out = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "lm_head.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
    }
    per_layer = 2 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN)
    layers = max(1, (size - 2 * 2 * VOCAB * HIDDEN) // per_layer)
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + f"self_attn.{n}.weight": (HIDDEN, HIDDEN) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        out |= {p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN)}
        out |= {p + "mlp.down_proj.weight": (HIDDEN, FFN)}
        out |= {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,)}
    return out


def write_weights(folder: str, size: int) -> int:
    """The weights as safetensors shards plus an index, by the reference writer; returns their bytes."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for name, shape in shapes(size).items():
        tensor = torch.randn(shape, generator=gen).to(torch.bfloat16)
        if shards[-1] and filled + tensor.nbytes > SHARD_BYTES:
            shards.append({})
            filled = 0
        shards[-1][name] = tensor
        filled += tensor.nbytes
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map |= {name: file for name in tensors}
        total += os.path.getsize(os.path.join(folder, file))
    index = {"metadata": {"total_size": sum(t.nbytes for s in shards for t in s.values())}, "weight_map": weight_map}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return total


def make_state(layout: str, names: dict[str, tuple[int, ...]]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import empty as dtensor_empty

    world = dist.get_world_size()
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(layout,))
    state = {}
    for name, shape in names.items():
        if layout == "hsdp":
            placements = [Replicate(), Shard(0)]
        elif layout == "fsdp":
            placements = [Shard(0)]
        elif len(shape) == 1:
            placements = [Replicate()]
        else:
            placements = [Shard(1) if any(r in name for r in ROWWISE) else Shard(0)]
        state[name] = dtensor_empty(*shape, dtype=torch.bfloat16, device_mesh=mesh, placements=placements)
    return state


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _total(value: int, op=dist.ReduceOp.SUM) -> int:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return int(t.item())


def rank_main(cfg: dict) -> list[dict]:
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    import ckptio

    counting.install_s3_counter()
    names = shapes(cfg["size"])
    rows = []
    for layout in cfg["layouts"]:
        state = make_state(layout, names)
        needed = _total(sum(v.to_local().nbytes for v in state.values()))
        reference = None
        for target, reader_name in (("local", "torch"), ("local", "ckptio"), ("s3", "ckptio")):
            url, options = (cfg["local"], None) if target == "local" else (cfg["s3"], cfg["s3_options"])
            times, reads = [], []
            for _ in range(cfg["repeats"]):
                reader = (
                    HuggingFaceStorageReader(url)
                    if reader_name == "torch"
                    else ckptio.HFReader(url, storage_options=options)
                )
                dist.barrier()
                counting.take_served_bytes()
                rchar, start = _rchar(), time.perf_counter()
                dcp.load(state, storage_reader=reader)
                seconds, rchar = time.perf_counter() - start, _rchar() - rchar
                times.append(_total(int(seconds * 1e6), dist.ReduceOp.MAX) / 1e6)
                reads.append(_total(counting.take_served_bytes() if target == "s3" else rchar))
            local = {k: v.to_local().clone() for k, v in state.items()}
            if reference is None:
                reference = local
            else:
                wrong = [k for k in local if not torch.equal(local[k], reference[k])]
                assert not wrong, f"{reader_name} on {target} loaded other values than torch's reader: {wrong[:3]}"
            for v in state.values():
                v.to_local().zero_()
            rows.append(
                {
                    "layout": layout,
                    "target": target,
                    "reader": reader_name,
                    "seconds": times,
                    "needed_bytes": needed,
                    "read_bytes": None if reader_name == "torch" else statistics.median(reads),
                }
            )
    return rows if dist.get_rank() == 0 else []


def table(rows: list[dict], world: int, file_bytes: int) -> str:
    torch_local = {r["layout"]: statistics.median(r["seconds"]) for r in rows if r["reader"] == "torch"}
    lines = [
        f"{'layout':<8} {'where':<6} {'reader':<7} {'load s (min-max)':>22} {'vs torch':>9} "
        f"{'needed MiB':>11} {'read MiB':>9} {'read/needed':>12} {'read/files':>11}"
    ]
    for r in rows:
        med = statistics.median(r["seconds"])
        spread = f"{med:.3f} ({min(r['seconds']):.3f}-{max(r['seconds']):.3f})"
        ratio = f"{med / torch_local[r['layout']]:.2f}x" if r["reader"] != "torch" and r["target"] == "local" else ""
        read = r["read_bytes"]
        name = {"fsdp": f"FSDP({world})", "tp": f"TP({world})", "hsdp": f"HSDP 2x{world // 2}"}[r["layout"]]
        lines.append(
            f"{name:<8} {r['target']:<6} {r['reader']:<7} {spread:>22} {ratio:>9} {r['needed_bytes'] / 2**20:>11.1f} "
            + (
                f"{read / 2**20:>9.1f} {read / r['needed_bytes']:>11.2f}x {read / file_bytes:>10.2f}x"
                if read is not None
                else f"{'(mmap)':>9}"
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptio.bench.hf_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MiB", help="bytes of bf16 weights (default 256MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=4, help="an even number (HSDP is 2 x ranks/2)")
    parser.add_argument("--layouts", default="fsdp,tp,hsdp")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.ranks % 2:
        parser.error("--ranks must be an even number >= 2")
    size = parse_size(args.size)
    use_test_credentials()
    with tempfile.TemporaryDirectory() as folder, local_s3_server() as endpoint:
        written = write_weights(folder, size)
        create_bucket(endpoint, "hf-bench")
        options = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}
        import fsspec

        fs = fsspec.filesystem("s3", **options)
        for name in os.listdir(folder):
            fs.put_file(os.path.join(folder, name), f"hf-bench/weights/{name}")
        cfg = {
            "size": size,
            "repeats": args.repeats,
            "layouts": args.layouts.split(","),
            "local": folder,
            "s3": "s3://hf-bench/weights",
            "s3_options": options,
        }
        print(f"{written / 2**20:.1f} MiB of safetensors files, {args.ranks} ranks, {args.repeats} repeats", flush=True)
        rows = launch(args.ranks, rank_main, cfg)[0]
    print(table(rows, args.ranks, written))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "file_bytes": written, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
