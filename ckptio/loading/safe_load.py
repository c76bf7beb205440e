"""Load planners: a safe one that never runs code from a checkpoint's pickled objects."""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ckptio.errors import CheckpointError, UnsafeObjectError
from ckptio.state.safe_pickle import safe_unpickle


class SafeObjectsMixin:
    """Restores non-tensor items with ``torch.load(weights_only=True)`` (and ``SAFE_BUILTINS``) in any
    DefaultLoadPlanner subclass."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = safe_unpickle(value)
        except pickle.UnpicklingError as exc:
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))
            needed = f"the global {found.group(1)!r}" if found else f"something unsafe ({str(exc).splitlines()[0]})"
            raise UnsafeObjectError(
                f"key {fqn!r}: the saved object needs {needed}, which the safe loader does not allow. If you "
                "trust this checkpoint, allow it with torch.serialization.add_safe_globals([...]) or load with "
                "planner=torch.distributed.checkpoint.DefaultLoadPlanner()"
            ) from None
        if self.flatten_state_dict:  # what DefaultLoadPlanner.load_bytes does after unpickling
            path, _ = path_as_held(self.original_state_dict, self.mappings[fqn])
            set_at_path(self.original_state_dict, path, obj)
        else:
            self.state_dict[fqn] = obj


def path_as_held(root: Mapping, path: tuple) -> tuple[tuple, Any]:
    """``path`` (torch's flattening writes every dict key as a string) with each part that names a
    non-string key of its container (``optimizer.state_dict()``'s int parameter ids) as that key,
    and the container its last part is set in (None where the state has none yet): torch's
    ``set_element`` would otherwise put the loaded value under a new string key beside the stale
    one, and the value the caller holds would silently stay unloaded."""
    out, container, parent = [], root, None
    for part in path:
        key = part
        if isinstance(container, Mapping) and isinstance(part, str) and part not in container:
            key = next((k for k in container if not isinstance(k, str) and str(k) == part), part)
        out.append(key)
        parent = container
        try:
            container = container[key]
        except (KeyError, IndexError, TypeError):
            container = None
    return tuple(out), parent


def set_at_path(root: dict, path: tuple, value: Any) -> None:
    """torch's ``set_element`` for paths whose dict keys need not be strings (``path_as_held``):
    missing containers are made as torch makes them (a dict before a name, a list before an index)."""
    container: Any = root
    for part, following in zip(path, path[1:], strict=False):
        fresh: Any = {} if type(following) is str else []
        if isinstance(container, Mapping):
            container = container.setdefault(part, fresh)
        else:
            container.extend([None] * (part + 1 - len(container)))
            if container[part] is None:
                container[part] = fresh
            container = container[part]
    if isinstance(container, list):
        container.extend([None] * (path[-1] + 1 - len(container)))
    container[path[-1]] = value


def restore_objects_under_held_keys(planner: LoadPlanner, plan: LoadPlan) -> None:
    """Point a torch ``DefaultLoadPlanner``'s flattening map at the keys the state really has
    (``path_as_held``) for the objects ``plan`` reads, so plain ``dcp.load`` restores them in place.
    ``SafeObjectsMixin`` planners resolve each path themselves as they set it."""
    if not isinstance(planner, DefaultLoadPlanner) or isinstance(planner, SafeObjectsMixin):
        return
    if not planner.flatten_state_dict:
        return
    for item in plan.items:
        fqn = item.dest_index.fqn
        if item.type != LoadItemType.BYTE_IO or fqn not in planner.mappings:
            continue
        path, parent = path_as_held(planner.original_state_dict, planner.mappings[fqn])
        if type(path[-1]) is int and isinstance(parent, Mapping):
            raise CheckpointError(
                f"key {fqn!r}: the object under the int key {path[-1]} cannot be restored in place by torch's "
                f"{type(planner).__name__}: it would land under a new string key {str(path[-1])!r}. Load with "
                "planner=ckptio.SafeLoadPlanner() (or ckptio.load), which keeps the key's type"
            )
        planner.mappings[fqn] = path


def _holds_sharded_tensor(value: Any) -> bool:
    from ckptio.torch_seam import ShardedTensor

    if isinstance(value, ShardedTensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_sharded_tensor(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_holds_sharded_tensor(v) for v in value)


class SafeLoadPlanner(SafeObjectsMixin, DefaultLoadPlanner):
    """Like torch's ``DefaultLoadPlanner``, but non-tensor items are restored with
    ``torch.load(weights_only=True)``: plain containers, numbers, strings, bytes and tensors
    only. Anything else raises ``ckptio.UnsafeObjectError`` naming the key and the type.

    To allow a type you trust: ``torch.serialization.add_safe_globals([MyType])``.
    """

    def set_up_planner(self, state_dict: dict, metadata: Any = None, is_coordinator: bool = False) -> None:
        # torch rebuilds the whole state to flatten ShardedTensors, and the rebuild turns the empty
        # containers of a list ({"groups": [{}, {}, {"p": t}]}) into None entries that its plan then
        # asks the checkpoint for ("Missing key ... groups.0"): rebuild only when there is one.
        rebuild = self.flatten_sharded_tensors
        self.flatten_sharded_tensors = rebuild and _holds_sharded_tensor(state_dict)
        try:
            super().set_up_planner(state_dict, metadata, is_coordinator)
        finally:
            self.flatten_sharded_tensors = rebuild
