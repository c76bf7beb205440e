"""What a user runs first, against ckptio as ``pip install`` puts it on a machine.

``make test-installed`` copies this file to a folder outside the checkout and runs it with the Python
of a clean virtual environment into which the wheel was installed (not editable): ``import ckptio``, a
save and load in one process and on 2 gloo ranks, a ``dcp.async_save``, a tiered save and
``ckptio.latest``, and every CLI verb on the checkpoints it saved. Every value is compared exactly.
It is a script, not a pytest module: the checkout must not be importable where it runs.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import ckptio

CHECKOUT = os.environ.get("CKPTIO_CHECKOUT")


def state(rank: int = 0) -> dict:
    torch.manual_seed(rank)
    return {
        "w": torch.randn(64, 32),
        "b": torch.arange(10, dtype=torch.int64),
        "step": 7,
        "blob": b"\x00\x01" * 100,
        "empty": b"",
    }


def zeroed(reference: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in reference.items()}


def assert_equal(loaded: dict, expected: dict, where: str) -> None:
    for key, value in expected.items():
        got = loaded[key]
        same = torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
        if not same:
            raise AssertionError(f"{where}: {key!r} loaded {got!r}, saved {value!r}")


def cli(*args: str, ok: tuple[int, ...] = (0,)) -> str:
    command = [os.path.join(os.path.dirname(sys.executable), "ckptio"), *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode not in ok:
        raise AssertionError(f"ckptio {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def one_process(root: str) -> None:
    saved = state()
    ckptio.save(saved, f"{root}/api")
    loaded = zeroed(saved)
    ckptio.load(loaded, f"{root}/api")
    assert_equal(loaded, saved, "ckptio.save/load")

    dcp.save(saved, storage_writer=ckptio.Writer(f"{root}/dcp", ckptio.WriterConfig(compression="zstd")))
    loaded = zeroed(saved)
    dcp.load(loaded, storage_reader=ckptio.Reader(f"{root}/dcp"), planner=ckptio.SafeLoadPlanner())
    assert_equal(loaded, saved, "dcp.save/load, zstd")

    dcp.async_save(saved, storage_writer=ckptio.Writer(f"{root}/async")).result()
    loaded = zeroed(saved)
    ckptio.load(loaded, f"{root}/async")
    assert_equal(loaded, saved, "dcp.async_save")

    from ckptio.saving import merge_once

    merge_once.IN_PROCESS_FRAGMENTS = 0  # the merge process of a large set, run from the installed wheel
    dcp.save(saved, storage_writer=ckptio.Writer(f"{root}/merged-apart"), use_collectives=False)
    ckptio.wait_for_uploads()
    merge_once.IN_PROCESS_FRAGMENTS = 64
    assert os.path.exists(f"{root}/merged-apart/ckptio.json"), os.listdir(f"{root}/merged-apart")
    loaded = zeroed(saved)
    ckptio.load(loaded, f"{root}/merged-apart")
    assert_equal(loaded, saved, "a save without a coordinator merged in a process of its own")

    tier = f"{root}/node-tier"
    for step, value in ((1, 1.0), (2, 2.0)):
        ckptio.save({"w": torch.full((8,), value)}, f"{root}/run/step-{step}", ckptio.WriterConfig(local_tier=tier))
    ckptio.wait_for_uploads()
    newest = ckptio.latest(f"{root}/run", local_tier=tier)
    assert newest == f"{root}/run/step-2", newest
    loaded = {"w": torch.zeros(8)}
    dcp.load(loaded, storage_reader=ckptio.Reader(newest, local_tier=tier))
    assert torch.equal(loaded["w"], torch.full((8,), 2.0)), loaded


def rank_main(rank: int, port: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mine = torch.full((4,), float(rank))
        shared = {"shared": torch.arange(6.0), "loader": ckptio.PerRank(mine, dp_rank=rank, dp_size=2)}
        ckptio.save(shared, f"{root}/ranks", ckptio.WriterConfig(mode="replica_group"))
        loaded = {"shared": torch.zeros(6), "loader": ckptio.PerRank(torch.zeros(4), dp_rank=rank, dp_size=2)}
        ckptio.load(loaded, f"{root}/ranks")
        assert torch.equal(loaded["shared"], torch.arange(6.0)), loaded
        assert torch.equal(loaded["loader"].value, mine), loaded
        plain = {"shared": torch.arange(6.0), "step": 3}
        dcp.save(plain, storage_writer=ckptio.Writer(f"{root}/no-coordinator"), use_collectives=False)
        dcp.async_save(plain, storage_writer=ckptio.Writer(f"{root}/ranks-async")).result()
        back = {"shared": torch.zeros(6), "step": 0}
        dcp.load(back, storage_reader=ckptio.Reader(f"{root}/ranks-async"))
        assert torch.equal(back["shared"], torch.arange(6.0)), back
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def every_cli_verb(root: str) -> None:
    """One call of each verb (each call imports torch: ~2.5 s)."""
    assert "'w'" in cli("inspect", f"{root}/api") or "w " in cli("inspect", f"{root}/api")
    cli("merge", f"{root}/no-coordinator")
    cli("verify", f"{root}/no-coordinator")
    cli("gc", f"{root}/ranks")
    assert cli("latest", "--local-tier", f"{root}/node-tier", f"{root}/run").strip() == f"{root}/run/step-2"
    assert "nothing to do" in cli("upgrade", f"{root}/api")  # already 1.0
    cli("convert", f"{root}/api", f"{root}/api.pt")
    loaded = torch.load(f"{root}/api.pt", weights_only=False)  # written by this script just now
    assert torch.equal(loaded["w"], state()["w"]), sorted(loaded)
    cli("delete", f"{root}/ranks-async")
    assert not os.path.exists(f"{root}/ranks-async/ckptio.json")
    cli("bench", "--help")


def main() -> None:
    where = os.path.dirname(os.path.abspath(ckptio.__file__))
    if CHECKOUT and where == os.path.join(os.path.abspath(CHECKOUT), "ckptio") or "site-packages" not in where:
        raise AssertionError(f"ckptio was imported from the checkout ({where}), not from the installed wheel")
    expected_torch = os.environ.get("CKPTIO_EXPECT_TORCH")
    if expected_torch and torch.__version__.split("+")[0] != expected_torch:
        raise AssertionError(f"installing ckptio's wheel changed torch to {torch.__version__} (was {expected_torch})")
    installed = importlib.metadata.version("ckptio")
    if installed != ckptio.__version__:
        raise AssertionError(f"the installed wheel says version {installed}, ckptio {ckptio.__version__}")
    print(f"ckptio {ckptio.__version__} from {where}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as root:
        for name, run in (
            ("one process", lambda: one_process(root)),
            ("2 gloo ranks", lambda: mp.spawn(rank_main, args=(free_port(), root), nprocs=2)),
            ("every CLI verb", lambda: every_cli_verb(root)),
        ):
            start = time.perf_counter()
            run()
            print(f"{name}: {time.perf_counter() - start:.1f} s")
    print("installed ckptio: one process, 2 gloo ranks, async, merged apart, tiered + latest, every verb: all exact")


if __name__ == "__main__":
    main()
