"""dtype conversion on load (``ckptio.loading.conversion``): exact conversions load, rounding only when
asked, the rest refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.loading.conversion import is_exact, is_rounding

pytestmark = pytest.mark.protocol

CONVERSION_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]


def _extremes(dtype: torch.dtype) -> torch.Tensor:
    """Values at the edges of ``dtype`` (range, precision, the smallest subnormal)."""
    if dtype == torch.bool:
        return torch.tensor([False, True])
    if dtype.is_complex:
        part = _extremes(torch.float32 if dtype == torch.complex64 else torch.float64)
        return torch.complex(part, part.flip(0))
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        values = [0.0, 1.0, -1.0, info.max, -info.max, info.smallest_normal, info.smallest_normal * info.eps]
        return torch.tensor(values, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.tensor([info.min, info.max, 0, 1, -1 if info.min else 2], dtype=dtype)


def test_exact_conversions_keep_every_value_and_the_others_change_some():
    """The rule itself, checked on each type's extreme values: what it calls exact keeps every one
    (compared as Python numbers), and every other pair changes at least one (a real loss refused)."""
    for stored in CONVERSION_DTYPES:
        values = _extremes(stored)
        for wanted in CONVERSION_DTYPES:
            converted = values.to(wanted)
            kept = all(a == b for a, b in zip(values.tolist(), converted.tolist(), strict=True))
            assert kept == is_exact(stored, wanted), (stored, wanted)


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("dtypes") / "ckpt")
    state = {str(d): _extremes(d) for d in CONVERSION_DTYPES}
    ckptio.save(state, url)
    return url, state


@pytest.mark.parametrize("stored", CONVERSION_DTYPES, ids=str)
def test_every_dtype_pair_loads_exactly_rounds_on_request_or_is_refused_by_name(stored, every_dtype):
    url, state = every_dtype
    key = str(stored)
    for wanted in CONVERSION_DTYPES:
        for allow_rounding in (False, True):
            target = {key: torch.zeros(state[key].shape, dtype=wanted)}
            allowed = is_exact(stored, wanted) or (allow_rounding and is_rounding(stored, wanted))
            if allowed:
                ckptio.load(target, url, allow_rounding=allow_rounding)
                assert torch.equal(target[key], state[key].to(wanted)), (stored, wanted)
                continue
            with pytest.raises(ckptio.LossyConversionError) as info:
                ckptio.load(target, url, allow_rounding=allow_rounding)
            message = str(info.value)
            assert f"key {key!r}" in message and str(stored) in message and str(wanted) in message
            assert ("allow_rounding=True" in message) == is_rounding(stored, wanted), message
            assert torch.count_nonzero(target[key]) == 0  # nothing written


def test_the_issue_examples_are_refused_through_plain_dcp_load_too(tmp_path):
    url = str(tmp_path / "ckpt")
    saved = {
        "step": torch.tensor(1099511627781),
        "f": torch.tensor([0.5, 1.7, -2.9]),
        "u": torch.tensor([200, 255], dtype=torch.uint8),
    }
    dcp.save(saved, storage_writer=ckptio.Writer(url), no_dist=True)
    for key, dtype in (("step", torch.int32), ("f", torch.int64), ("u", torch.int8)):
        with pytest.raises(BaseException) as info:  # noqa: B017 - torch wraps it in CheckpointException
            dcp.load({key: torch.zeros(saved[key].shape, dtype=dtype)}, storage_reader=ckptio.Reader(url), no_dist=True)
        assert isinstance(ckptio.unwrap(info.value), ckptio.LossyConversionError), info.value
