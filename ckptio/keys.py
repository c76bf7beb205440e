"""Canonical key names: the segments wrappers insert (``_orig_mod`` from torch.compile,
``_checkpoint_wrapped_module`` from activation checkpointing) are never stored, so a checkpoint
moves freely between wrapped and unwrapped models. Modules passed as values are expanded
with torch's ``get_model_state_dict``, which also removes DDP's ``module.`` precisely."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from .errors import CheckpointError
from .per_rank import PerRank

WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module")


def canonical_key(key: str) -> str:
    return ".".join(part for part in key.split(".") if part not in WRAPPER_SEGMENTS)


def canonicalize(state: dict[str, Any], path: str = "") -> dict[str, Any]:
    """A new nested dict with canonical keys; values (tensors) are shared, the caller's dict is untouched."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = canonical_key(key) if isinstance(key, str) else key
        if name in out:
            raise CheckpointError(
                f"keys {key!r} and another key under {path or 'the top level'!r} both become {name!r} once wrapper "
                "segments are removed; rename one of them"
            )
        if isinstance(value, nn.Module):
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            value = get_model_state_dict(value)
        out[name] = canonicalize(value, f"{path}.{name}" if path else str(name)) if isinstance(value, dict) else value
    return out


def copy_back(original: dict[str, Any], loaded: dict[str, Any]) -> None:
    """After a load into ``canonicalize(original)``, put restored objects back under the caller's keys
    (tensors were loaded in place already); modules get their state with ``set_model_state_dict``."""
    for key, value in original.items():
        name = canonical_key(key) if isinstance(key, str) else key
        if name not in loaded:
            continue
        if isinstance(value, PerRank):
            continue  # restored into the PerRank object itself
        if isinstance(value, nn.Module):
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(value, loaded[name])
        elif isinstance(value, dict):
            copy_back(value, loaded[name])
        elif loaded[name] is not value:
            original[key] = loaded[name]
