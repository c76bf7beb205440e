"""The one rule for loading a stored dtype into a tensor of another: every exact widening is allowed;
rounding to a type of less precision or range only when the load opts in; nothing else. Pure.

Exact: integers into integers whose range holds theirs, bool into anything, integers into floating
point whose significand holds them (int16 into fp32, int32 into fp64), floating point into floating
point or complex of at least its precision and range (bf16 or fp16 into fp32). Rounding (opt-in,
``allow_rounding=True``): floating point into a floating-point type of less precision or range (fp32
into bf16; complex alike). Never: floating point into integers (truncation), narrower or
sign-changing integers (wrap-around), integers into floating point that cannot hold them all (ids
and counters are not values to round), complex into real (the imaginary part dropped).
"""

from __future__ import annotations

import math

import torch

from ckptio.errors import LossyConversionError

_INTEGERS = {
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64
}  # fmt: skip


def _is_int(dtype: torch.dtype) -> bool:
    """A plain integer type: not bool, not quantized (whose values carry a scale)."""
    return dtype in _INTEGERS


def _component(dtype: torch.dtype) -> torch.dtype:
    """The real type of a complex type's parts (or the type itself)."""
    return {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}.get(
        dtype, dtype
    )


def _significand_bits(dtype: torch.dtype) -> int:
    """Bits of precision, the implicit one included (fp32: 24, bf16: 8): ``eps`` is 2 ** (1 - bits)."""
    return 1 - round(math.log2(torch.finfo(dtype).eps))


def _float_holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Whether every value of floating-point type ``narrow`` is a value of ``wide`` (types torch
    gives no full ``finfo``, such as packed sub-byte floats, hold nothing for certain)."""
    try:
        w, n = torch.finfo(wide), torch.finfo(narrow)
        return (
            _significand_bits(wide) >= _significand_bits(narrow)
            and w.max >= n.max
            and w.smallest_normal * w.eps <= n.smallest_normal * n.eps  # the smallest subnormals
        )
    except (TypeError, NotImplementedError, RuntimeError):
        return False


def is_exact(stored: torch.dtype, wanted: torch.dtype) -> bool:
    """Whether every value of ``stored`` converts to ``wanted`` unchanged."""
    if stored == wanted or stored == torch.bool:
        return True
    if _is_int(stored) and _is_int(wanted):
        have, want = torch.iinfo(stored), torch.iinfo(wanted)
        return want.min <= have.min and have.max <= want.max
    if stored.is_complex and not wanted.is_complex:
        return False
    target = _component(wanted)
    if not target.is_floating_point:
        return False
    if _is_int(stored):
        info = torch.iinfo(stored)
        return _float_holds(target, target) and max(-info.min, info.max) <= 2 ** _significand_bits(target)
    source = _component(stored)
    return source.is_floating_point and _float_holds(target, source)


def is_rounding(stored: torch.dtype, wanted: torch.dtype) -> bool:
    """Whether the conversion only rounds floating-point values (to nearest; past the range, to
    infinity): real or complex into real or complex, not complex into real."""
    if stored.is_complex and not wanted.is_complex:
        return False
    return (stored.is_floating_point or stored.is_complex) and (wanted.is_floating_point or wanted.is_complex)


def check_conversion(stored: torch.dtype, wanted: torch.dtype, where: str, allow_rounding: bool = False) -> None:
    """Raise ``LossyConversionError`` naming ``where`` (the key and file) unless loading ``stored``
    into ``wanted`` is exact, or only rounds and ``allow_rounding`` is set."""
    if is_exact(stored, wanted) or (allow_rounding and is_rounding(stored, wanted)):
        return
    if is_rounding(stored, wanted):
        fix = (
            "the conversion rounds values; to accept that, load with allow_rounding=True (Reader, HFReader, "
            "ckptio.load), or give the state a tensor of the stored dtype"
        )
    else:
        fix = (
            "the conversion can change values (truncation, wrap-around, rounded integers or a dropped imaginary "
            "part); give the state a tensor of the stored dtype, or one that holds every value of it"
        )
    raise LossyConversionError(f"{where} holds {stored}, but the state's tensor is {wanted}: {fix}")
