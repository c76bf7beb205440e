"""Where a checkpoint's fast-tier copy lives on a node, and which step of a run is the newest.

A durable checkpoint ``<run>/<step>`` (any URL) has its fast-tier copy at
``<local_tier>/<run key>/<step>``: the run key names the run's URL readably and, by a hash,
exactly, so two runs (or buckets) never share a folder and ``ckptio.latest(run)`` finds a run's
steps by listing one folder.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

from fsspec.core import split_protocol

from ckptio.config import StorageConfig
from ckptio.storage import FsspecStore, open_store

#: A rank's record of what its fast-tier data file holds, beside the file (``held_index.py``).
HELD_SUFFIX = ".held.json"


def normalized_url(url: str | os.PathLike) -> str:
    """One spelling per location: no trailing slash; a plain path made absolute."""
    text = os.fspath(url)
    protocol, _ = split_protocol(text)
    if protocol in (None, "file", "local"):
        return os.path.abspath(text.split("://", 1)[-1])
    return text.rstrip("/")


def split_step(checkpoint_url: str | os.PathLike) -> tuple[str, str]:
    """``(run URL, step name)`` of a checkpoint URL: its parent and its last path segment."""
    url = normalized_url(checkpoint_url)
    run, _, step = url.rpartition("/")
    if not step or not run or run.endswith(":/"):
        raise ValueError(
            f"a tiered checkpoint's URL must name a step inside a run folder (e.g. s3://bucket/run/step-100), "
            f"got {os.fspath(checkpoint_url)!r}"
        )
    return run, step


def run_key(run_url: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> str:
    """The run's folder name: its URL, readably, and a hash of the URL and of the endpoint it is on
    (``s3://bucket/run`` on two S3 services are two runs)."""
    url = normalized_url(run_url)
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", url).strip("_.")[-80:]
    endpoint = _endpoint(storage_options or {})
    identity = url if endpoint is None else f"{url} at {endpoint}"
    return f"{readable}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"


def _endpoint(storage_options: dict[str, Any]) -> str | None:
    endpoint = storage_options.get("endpoint_url") or (storage_options.get("client_kwargs") or {}).get("endpoint_url")
    return str(endpoint).rstrip("/") if endpoint else None


def local_run_path(
    local_tier: str | os.PathLike, run_url: str | os.PathLike, storage_options: dict[str, Any] | None = None
) -> str:
    return os.path.join(os.path.abspath(os.fspath(local_tier)), run_key(run_url, storage_options))


def local_step_path(
    local_tier: str | os.PathLike, checkpoint_url: str | os.PathLike, storage_options: dict[str, Any] | None = None
) -> str:
    run, step = split_step(checkpoint_url)
    return os.path.join(local_run_path(local_tier, run, storage_options), step)


def local_step_store(
    local_tier: str | os.PathLike,
    checkpoint_url: str | os.PathLike,
    storage_options: dict[str, Any] | None,
    config: StorageConfig,
) -> FsspecStore:
    """The node's fast-tier folder of the checkpoint at ``checkpoint_url`` (with the durable tier's
    ``storage_options``), as a store."""
    return open_store(local_step_path(local_tier, checkpoint_url, storage_options), None, config)


def step_order(name: str) -> tuple[int, str]:
    """Newest last: by the last number in the step's name (``step-99`` before ``step-100``), then by name."""
    numbers = re.findall(r"\d+", name)
    return (int(numbers[-1]) if numbers else -1, name)
