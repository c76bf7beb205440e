"""``paused_gc()``: the cyclic garbage collector paused while metadata is built or parsed.

Plans, write results and metadata records run to millions of small acyclic objects at thousands of
ranks; each allocation burst triggers collections that walk every live object again. Measured on a
1,024-rank FSDP plan (4 layers of a 70B model): decoding ckptio.json 4.8 s -> 2.0 s, finish
2.3 s -> 1.0 s. Reference counting still frees everything; a collector the caller disabled stays so.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Use as ``with paused_gc():`` or as a decorator ``@paused_gc()``."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
