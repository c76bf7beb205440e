"""Load planners: a safe one that never runs code from a checkpoint's pickled objects."""

from __future__ import annotations

import io
import pickle
import re

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from .errors import UnsafeObjectError


class SafeObjectsMixin:
    """Restores non-tensor items with ``torch.load(weights_only=True)`` in any DefaultLoadPlanner subclass."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))
            needed = f"the global {found.group(1)!r}" if found else f"something unsafe ({str(exc).splitlines()[0]})"
            raise UnsafeObjectError(
                f"key {fqn!r}: the saved object needs {needed}, which the safe loader does not allow. If you "
                "trust this checkpoint, allow it with torch.serialization.add_safe_globals([...]) or load with "
                "planner=torch.distributed.checkpoint.DefaultLoadPlanner()"
            ) from None
        if self.flatten_state_dict:  # what DefaultLoadPlanner.load_bytes does after unpickling
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeLoadPlanner(SafeObjectsMixin, DefaultLoadPlanner):
    """Like torch's ``DefaultLoadPlanner``, but non-tensor items are restored with
    ``torch.load(weights_only=True)``: plain containers, numbers, strings, bytes and tensors
    only. Anything else raises ``ckptio.UnsafeObjectError`` naming the key and the type.

    To allow a type you trust: ``torch.serialization.add_safe_globals([MyType])``.
    """
