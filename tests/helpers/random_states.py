"""Random nested training states (dicts with str and int keys, lists, tuples, empty containers,
scalars, tensors of many dtypes, 0-d and empty ones) for round-trip properties, and exact comparison.
Imported by the tests and by spawned ranks."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), max_size=3))  # [] is 0-d; a 0 makes it empty
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g).to(dtype)


SCALARS = st.one_of(
    st.integers(-(2**40), 2**40), st.floats(allow_nan=False, width=64), st.text(max_size=8), st.booleans(), st.none()
)
#: Every other builtin a training state may hold (a sampler's bytes, a seen-ids set, a 128-bit seed), each
#: of which ckptio.save must save and every safe load must restore as it was (issue 50's b"").
BUILTINS = st.one_of(
    st.binary(max_size=8),  # b"" included: pickle writes it as a call of the bytes global
    st.binary(max_size=8).map(bytearray),
    st.sets(st.integers(-5, 5), max_size=3),
    st.frozensets(st.text(max_size=3), max_size=3),
    st.complex_numbers(allow_nan=False, max_magnitude=1e6),
    st.integers(-(2**200), 2**200),
    st.builds(range, st.integers(-5, 5), st.integers(-5, 5)),
    st.builds(slice, st.integers(0, 3), st.none() | st.integers(4, 9)),
    st.just(...),
)
KEYS = st.one_of(
    st.text(st.characters(codec="ascii", exclude_characters="."), min_size=1, max_size=6), st.integers(0, 9)
)


def _containers(children):
    return st.one_of(
        st.dictionaries(KEYS, children, max_size=4),
        st.lists(children, max_size=4),
        st.tuples(children, children),
    )


VALUES = st.recursive(st.one_of(tensors(), SCALARS, BUILTINS), _containers, max_leaves=12)


@st.composite
def states(draw) -> dict[str, Any]:
    """A top-level dict with str keys (as a state dict has), anything below it."""
    top = draw(st.dictionaries(KEYS.filter(lambda k: isinstance(k, str)), VALUES, min_size=1, max_size=4))
    # keys must stay distinct once torch's flattening writes them as strings: "1" and 1 would collide
    return draw(st.just(top).filter(_distinct_as_strings))


def _distinct_as_strings(value: Any) -> bool:
    if isinstance(value, dict):
        names = [str(k) for k in value]
        return len(set(names)) == len(names) and all(_distinct_as_strings(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_distinct_as_strings(v) for v in value)
    return True


def blank(value: Any) -> Any:
    """The same structure with other values: tensors zeroed in place of the same shape and dtype,
    scalars changed, so that a value that is not loaded shows."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: blank(v) for k, v in value.items()}
    if isinstance(value, list):
        return [blank(v) for v in value]
    if isinstance(value, tuple):
        return tuple(blank(v) for v in value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float, complex)):
        return value + 1
    if isinstance(value, (bytes, bytearray)):
        return type(value)(bytes(value) + b"?")
    if isinstance(value, (set, frozenset)):
        return type(value)({"stale"})
    if isinstance(value, str):
        return value + "?"
    return "stale"  # None


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Where ``actual`` is not exactly ``expected``: types (int keys stay ints, tuples stay tuples),
    keys, tensor dtypes, shapes and bits, scalar values."""
    where = path or "<root>"
    if type(expected) is not type(actual) and not (
        isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)
    ):
        return [f"{where}: {type(actual).__name__} {actual!r:.60} where {type(expected).__name__} was saved"]
    if isinstance(expected, torch.Tensor):
        if expected.dtype != actual.dtype or expected.shape != actual.shape:
            return [f"{where}: {actual.dtype} {tuple(actual.shape)} where {expected.dtype} {tuple(expected.shape)}"]
        same = torch.equal(expected.reshape(-1).view(torch.uint8), actual.reshape(-1).view(torch.uint8))
        return [] if same else [f"{where}: tensor values differ"]
    if isinstance(expected, dict):
        if set(expected) != set(actual):
            return [f"{where}: keys {sorted(map(repr, actual))} where {sorted(map(repr, expected))} were saved"]
        return [d for k in expected for d in differences(expected[k], actual[k], f"{path}[{k!r}]")]
    if isinstance(expected, (list, tuple)):
        if len(expected) != len(actual):
            return [f"{where}: {len(actual)} entries where {len(expected)} were saved"]
        return [
            d for i, (e, a) in enumerate(zip(expected, actual, strict=True)) for d in differences(e, a, f"{path}[{i}]")
        ]
    return [] if expected == actual else [f"{where}: {actual!r:.60} where {expected!r:.60} was saved"]


def round_trip(state: dict, url: str) -> list[str]:
    """Save ``state`` with ``ckptio.save`` and load it into a blanked copy with ``ckptio.load``
    (on every rank of the default group, when there is one); the differences found."""
    import ckptio

    ckptio.save(state, url)
    target = blank(state)
    ckptio.load(target, url)
    return differences(state, target)
