"""Safe loading (``ckptio.loading.safe_load``): no code runs from a checkpoint's objects."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

import ckptio
from tests.helpers.random_states import blank


class RunsCode:
    """A pickle that executes code when loaded unsafely."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def test_safe_loading_refuses_code_in_objects(tmp_path):
    marker = str(tmp_path / "pwned")
    url = str(tmp_path / "evil")
    dcp.save({"w": torch.ones(4), "payload": RunsCode(marker)}, storage_writer=ckptio.Writer(url))
    with pytest.raises(ckptio.UnsafeObjectError, match=r"key 'payload'.*(exec|builtins)"):
        ckptio.load({"w": torch.zeros(4), "payload": None}, url)
    assert not os.path.exists(marker)
    with pytest.raises(CheckpointException) as raw:  # plain dcp.load wraps it in torch's BaseException
        dcp.load(
            {"w": torch.zeros(4), "payload": None}, storage_reader=ckptio.Reader(url), planner=ckptio.SafeLoadPlanner()
        )
    assert isinstance(ckptio.unwrap(raw.value), ckptio.UnsafeObjectError)
    assert not os.path.exists(marker)
    # torch's default planner would run it: the danger the safe planner removes
    dcp.load({"w": torch.zeros(4), "payload": None}, storage_reader=ckptio.Reader(url), planner=DefaultLoadPlanner())
    assert open(marker).read() == "pwned"


BUILTIN_VALUES = {
    "empty bytes": b"",
    "bytes": b"\x00\xff",
    "bytearray": bytearray(b"ab"),
    "empty bytearray": bytearray(),
    "set": {1, 2},
    "empty set": set(),
    "frozenset": frozenset({"a"}),
    "empty frozenset": frozenset(),
    "complex": 1 - 2j,
    "big int": -(2**100),
    "range": range(2, 9, 3),
    "slice": slice(1, None),
    "Ellipsis": ...,
    "nested empties": {"a": [], "b": {}, "c": (), "d": [b"", {}]},
}


@pytest.mark.parametrize("name", list(BUILTIN_VALUES))
def test_every_builtin_a_state_holds_saves_and_loads_through_both_apis(name, tmp_path):
    """Issue 50: ``{"sampler": b""}`` saved and never loaded (pickle writes b"" as a call of the ``bytes``
    global, which torch's weights-only unpickler refuses). What ckptio saves, its safe loaders restore."""
    value = BUILTIN_VALUES[name]
    ckptio.save({"w": torch.ones(2), "v": value}, str(tmp_path / "api"))
    loaded = {"w": torch.zeros(2), "v": blank(value)}
    ckptio.load(loaded, str(tmp_path / "api"))
    assert loaded["v"] == value and type(loaded["v"]) is type(value)
    dcp.save({"v": value}, storage_writer=ckptio.Writer(str(tmp_path / "dcp")))
    loaded = {"v": blank(value)}
    dcp.load(loaded, storage_reader=ckptio.Reader(str(tmp_path / "dcp")), planner=ckptio.SafeLoadPlanner())
    assert loaded["v"] == value and type(loaded["v"]) is type(value)


def test_bytes_called_with_an_argument_is_still_refused(tmp_path):
    """b"" is taken as ``bytes()``; ``bytes(n)`` would allocate n bytes from a number in the file."""

    class Allocates:
        def __reduce__(self):
            return (bytes, (1 << 40,))

    url = str(tmp_path / "ckpt")
    dcp.save({"x": Allocates()}, storage_writer=ckptio.Writer(url))
    with pytest.raises(ckptio.UnsafeObjectError, match="key 'x'"):
        ckptio.load({"x": None}, url)
