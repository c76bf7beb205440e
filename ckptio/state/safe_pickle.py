"""Unpickling a checkpoint's objects without running its code: torch's weights-only unpickler, plus the
harmless builtins it refuses."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch


def _empty_bytes(*args: Any) -> bytes:
    """``b""`` as pickle's protocol 2 writes it (a call of ``bytes`` with no arguments; non-empty bytes go
    through ``_codecs.encode``, which torch allows). ``bytes(n)`` with an argument would allocate ``n``
    bytes from a number in the file: refused."""
    if args:
        raise pickle.UnpicklingError("GLOBAL builtins.bytes called with arguments (pickle writes bytes() only for b'')")
    return b""


#: Builtin values a training state holds whose pickles torch's weights-only unpickler refuses, each
#: harmless to rebuild: taken by the safe loader, so that whatever ``ckptio.save`` saves of them loads.
#: (``collections.deque`` and ``defaultdict`` stay refused: torch's unpickler cannot fill a deque, and a
#: defaultdict's factory is any global.)
SAFE_BUILTINS = [(_empty_bytes, "builtins.bytes"), frozenset, range, slice, (Ellipsis, "builtins.Ellipsis")]


def safe_unpickle(value: io.BytesIO) -> Any:
    """``torch.load(weights_only=True)`` that also takes ``SAFE_BUILTINS``."""
    with torch.serialization.safe_globals(SAFE_BUILTINS):
        return torch.load(value, weights_only=True)
