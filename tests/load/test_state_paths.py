"""Nested states of every path shape (int keys, lists, empty containers) round trip through ckptio and
plain DCP, or fail naming the key."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import ckptio
from ckptio.tools.cli import main as cli_main
from tests.helpers.harness import spawn
from tests.helpers.random_states import blank, differences, round_trip, states

pytestmark = pytest.mark.protocol

T = torch.arange(6.0)


PATH_SHAPES = {
    "empty dicts before a dict in a list": {"opt": {"groups": [{}, {}, {"p": T.clone()}]}},
    "nested lists": {"a": [[T.clone(), {"x": T.clone() + 1}], [], [[{"y": T.clone() + 2}]]]},
    "empty lists and lists of lists": {"l": [[], [{}], [{"p": T.clone()}, []]], "e": []},
    "int keys (optimizer state)": {
        "opt": {
            "state": {0: {"n_iter": 7, "step": torch.tensor(3.0), "d": T.clone()}, 1: {"prev_loss": 0.25}},
            "param_groups": [{"lr": 0.1, "params": [0, 1]}],
        }
    },
    "int keys holding objects and tuples": {"s": {1: (T.clone(), 5), 2: 9, 3: [1, 2]}},
    "an int key holding a list of tensors": {"s": {0: [T.clone(), T.clone() * 2]}},
}


@pytest.mark.parametrize("name", list(PATH_SHAPES))
def test_every_path_shape_round_trips_through_ckptio_save_and_load(name, tmp_path):
    state = PATH_SHAPES[name]
    assert round_trip(state, str(tmp_path / "ckpt")) == []
    assert cli_main(["inspect", str(tmp_path / "ckpt")]) == 0
    assert cli_main(["verify", "-q", str(tmp_path / "ckpt")]) == 0


@pytest.mark.parametrize("name", list(PATH_SHAPES))
@pytest.mark.parametrize("planner", ["SafeLoadPlanner", "DefaultLoadPlanner"])
def test_plain_dcp_load_restores_every_path_shape_or_says_why(name, planner, tmp_path):
    """ckptio.SafeLoadPlanner restores each exactly; torch's DefaultLoadPlanner either does or fails
    loudly (it rebuilds lists with None for empty containers, and cannot set an object under an
    int key): it never leaves a stale value behind without a word."""
    state = PATH_SHAPES[name]
    url = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=ckptio.Writer(url), no_dist=True)
    target = blank(state)
    load_planner = ckptio.SafeLoadPlanner() if planner == "SafeLoadPlanner" else DefaultLoadPlanner()
    try:
        dcp.load(target, storage_reader=ckptio.Reader(url), planner=load_planner, no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException
        assert planner == "DefaultLoadPlanner", exc
        message = str(ckptio.unwrap(exc))
        assert "Missing key" in message or "ckptio.SafeLoadPlanner" in message, message
        return
    assert differences(state, target) == []


def test_a_save_whose_metadata_would_not_load_is_refused_before_it_commits(tmp_path, monkeypatch):
    monkeypatch.setattr(ckptio.format.rules, "LIST_INDEX_LIMIT", 3)  # the decoder's bound on a list index
    url = str(tmp_path / "ckpt")
    with pytest.raises(ckptio.CheckpointError, match="would not load, so the save was not committed.*list index"):
        ckptio.save({"l": [{}, {}, {}, {}, {"p": T}]}, url)
    assert not os.path.exists(os.path.join(url, "ckptio.json"))
    ckptio.save({"l": [{}, {}, {"p": T}]}, url)  # index 2 is within the bound: saved, and it loads
    target = {"l": [{}, {}, {"p": torch.zeros(6)}]}
    ckptio.load(target, url)
    assert torch.equal(target["l"][2]["p"], T)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(state=states())
def test_random_nested_states_round_trip_in_one_process(state, tmp_path_factory):
    url = str(tmp_path_factory.mktemp("state") / "ckpt")
    assert round_trip(state, url) == []


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(state=states())
def test_random_nested_states_through_plain_dcp_load_exact_or_refused(state, tmp_path_factory):
    """Plain dcp.save/dcp.load with Writer and Reader: ckptio.SafeLoadPlanner restores every random
    state exactly; torch's DefaultLoadPlanner restores it exactly or fails loudly, never leaving a
    stale value without a word."""
    url = str(tmp_path_factory.mktemp("plain") / "ckpt")
    dcp.save(state, storage_writer=ckptio.Writer(url), no_dist=True)
    target = blank(state)
    dcp.load(target, storage_reader=ckptio.Reader(url), planner=ckptio.SafeLoadPlanner(), no_dist=True)
    assert differences(state, target) == []
    target = blank(state)
    try:
        dcp.load(target, storage_reader=ckptio.Reader(url), no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException
        message = str(ckptio.unwrap(exc))
        assert "Missing key" in message or "ckptio.SafeLoadPlanner" in message, message
        return
    assert differences(state, target) == []


@pytest.mark.parametrize("world", [2, 4])
def test_random_nested_states_round_trip_on_ranks(world, tmp_path_factory):
    """The same states through ``ckptio.save``/``load`` on 2 and 4 gloo ranks (every rank holding the
    same state: replicated objects and tensors, written once), a few examples per world size."""
    examples = iter(range(10**6))

    @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(state=states())
    def run(state):
        url = str(tmp_path_factory.mktemp(f"ranks{world}-{next(examples)}") / "ckpt")
        assert spawn(world, round_trip, state, url) == [[]] * world

    run()
