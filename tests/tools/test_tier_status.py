"""``ckptio inspect --local-tier`` and ``ckptio gc --local-tier``: a node's fast tier, step by step."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.tiers.paths import local_run_path
from ckptio.tools.cli import main as cli_main


def _state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 128, generator=gen), "step": torch.tensor(step)}


def _save(durable, fast, step: int, **config) -> str:
    url = str(durable / f"step-{step}")
    dcp.save(_state(step), storage_writer=ckptio.Writer(url, ckptio.WriterConfig(local_tier=str(fast), **config)))
    return url


@pytest.fixture(autouse=True)
def _no_leftover_drains():
    yield
    ckptio.wait_for_uploads(timeout=60)


def test_gc_removes_drained_steps_beyond_keep_and_abandoned_ones_never_an_undrained_newest(tmp_path, capsys):
    durable, fast = tmp_path / "durable" / "run", tmp_path / "fast"
    cut_off = {"drain_bandwidth": 1, "tuning": ckptio.Tuning(drain_timeout_s=0.5)}
    for step in (1, 2, 3, 4, 5):  # step 2's drain was cut off, step 4 committed after it; step 5, the newest, too
        _save(durable, fast, step, local_tier_keep=5, **(cut_off if step in (2, 5) else {}))
        try:
            ckptio.wait_for_uploads()
        except ckptio.DrainError:
            assert step in (2, 5)

    assert cli_main(["gc", str(durable), "--local-tier", str(fast), "--keep", "2"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("step-")}
    assert [s for s, line in lines.items() if "removable" in line] == ["step-1", "step-2", "step-3"]
    assert "never committed on the durable tier" in lines["step-2"] and "step-4" in lines["step-2"]
    assert "not on the durable tier yet" in lines["step-5"]
    assert sorted(os.listdir(local_run_path(fast, durable))) == [f"step-{n}" for n in (1, 2, 3, 4, 5)]  # listed only

    assert cli_main(["gc", str(durable), "--local-tier", str(fast), "--keep", "2", "--delete"]) == 0
    assert "removed 3 of 3 step(s)" in capsys.readouterr().out
    assert sorted(os.listdir(local_run_path(fast, durable))) == ["step-4", "step-5"]
    # what was kept still restarts: step 5 from the node, its commit finished by latest
    assert ckptio.latest(str(durable), local_tier=str(fast)) == str(durable / "step-5")
    loaded = {"w": torch.zeros(256, 128), "step": torch.tensor(0)}
    dcp.load(loaded, storage_reader=ckptio.Reader(str(durable / "step-5"), local_tier=str(fast)))
    assert torch.equal(loaded["w"], _state(5)["w"]) and int(loaded["step"]) == 5


def test_gc_of_a_tier_that_holds_nothing_of_the_run(tmp_path, capsys, clean_env):
    assert cli_main(["gc", str(tmp_path / "run"), "--local-tier", str(tmp_path / "fast")]) == 0
    assert "holds no step of the run" in capsys.readouterr().out


def test_inspect_shows_the_node_copy_and_describes_a_checkpoint_still_draining(tmp_path, capsys):
    durable, fast = tmp_path / "durable" / "run", tmp_path / "fast"
    url = _save(durable, fast, 7, drain_bandwidth=40_000)  # 128 KiB: about three seconds to drain
    assert cli_main(["inspect", url, "--local-tier", str(fast)]) == 0
    out = capsys.readouterr().out
    assert "durable tier NOT committed yet (described from this node's copy)" in out
    assert "holds the metadata" in out and "NOT uploaded" in out and "w " in out

    ckptio.wait_for_uploads()
    assert cli_main(["inspect", url, "--local-tier", str(fast), "--json"]) == 0
    tiers = json.loads(capsys.readouterr().out)["tiers"]
    assert tiers["durable_committed"] is True and tiers["node"]["committed_here"] is True
    (held,) = tiers["node"]["files"]
    assert held["on_durable"] is True and held["durable_bytes"] == os.path.getsize(durable / "step-7" / held["file"])

    assert cli_main(["inspect", url, "--local-tier", str(tmp_path / "other-node")]) == 0
    assert "this node holds no copy" in capsys.readouterr().out


def test_inspect_without_a_copy_anywhere_says_the_checkpoint_is_missing(tmp_path, capsys):
    assert cli_main(["inspect", str(tmp_path / "run" / "step-1"), "--local-tier", str(tmp_path / "fast")]) == 2
    assert "ckptio: error:" in capsys.readouterr().err
