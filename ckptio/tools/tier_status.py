"""What a node's fast tier holds: of one checkpoint (``ckptio inspect --local-tier``) and of a whole
run, with which steps are safe to remove (``ckptio gc --local-tier``).

A step's fast-tier folder holds the files of the node's ranks and their held indexes, and, with
``local_tier_copies``, the copies of its partner nodes' ranks' files (and ``ckptio.json``): listed, sized
and removed with the step like the node's own (each file says whose rank it is). Whether a step may go
is decided by the durable tier, as the writer's own pruning decides: a step committed there is
removable beyond the newest ``keep``; a step never committed there is kept while a drain or
``ckptio.latest`` can still finish it, and removable once a newer step committed durably (``latest``
never resumes an older one).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

from ckptio.errors import CheckpointError
from ckptio.format.names import METADATA_NAME, parse_data_file_name, parse_fragment_name
from ckptio.storage import open_store
from ckptio.tiers.held_index import HeldIndex
from ckptio.tiers.node_notes import node_step
from ckptio.tiers.paths import HELD_SUFFIX, local_run_path, local_step_path, normalized_url, step_order


@dataclasses.dataclass(frozen=True)
class NodeStep:
    step: str
    path: str
    size: int  # bytes of every file in the step's folder
    committed_here: bool  # this node holds the step's ckptio.json
    ranks: tuple[int, ...]  # the saving ranks whose files it holds (its own, and partners' copies)
    on_durable: bool  # committed on the durable tier
    removable: bool
    why: str


def node_steps(run_url: str, local_tier: str, storage_options: dict[str, Any] | None, keep: int) -> list[NodeStep]:
    """Every step of ``run_url`` in this node's fast tier, oldest first, each with its verdict."""
    run = normalized_url(run_url)
    local_run = local_run_path(local_tier, run, storage_options)
    try:
        folders = sorted((e for e in os.scandir(local_run) if e.is_dir()), key=lambda e: step_order(e.name))
    except FileNotFoundError:
        return []
    durable = {e.name: open_store(f"{run}/{e.name}", storage_options).exists(METADATA_NAME) for e in folders}
    newest_durable = max((s for s, committed in durable.items() if committed), key=step_order, default=None)
    newest = {e.name for e in folders[-keep:]}
    steps = []
    for entry in folders:
        step = entry.name
        if durable[step]:
            removable = step not in newest
            why = "on the durable tier; " + (f"beyond the newest {keep}" if removable else f"one of the newest {keep}")
        elif (passed := _passed_over(entry.path)) is not None:
            removable, why = True, passed
        elif newest_durable is not None and step_order(step) < step_order(newest_durable):
            removable = True
            why = (
                f"never committed on the durable tier, which holds the newer {newest_durable}: its drain failed or "
                "was cut off, and ckptio.latest never resumes an older step"
            )
        else:
            removable = False
            why = "not on the durable tier yet: a drain is pending or was cut off (ckptio.latest finishes it)"
        steps.append(
            NodeStep(
                step,
                entry.path,
                _folder_size(entry.path),
                os.path.exists(os.path.join(entry.path, METADATA_NAME)),
                _ranks_in(entry.path),
                durable[step],
                removable,
                why,
            )
        )
    return steps


def _passed_over(path: str) -> str | None:
    """Why a step not on the durable tier is no checkpoint any more (``node_notes``), or ``None``."""
    noted = node_step(path)
    held = [n for n in os.listdir(path) if n == METADATA_NAME or parse_fragment_name(n) is not None]
    if held and not noted.documents:
        return (
            "passed over by ckptio.latest (incomplete, damaged, mixed, deleted or superseded on the durable tier); "
            "a new save to this step replaces it"
        )
    if any(document.save_id in noted.durable for document in noted.documents.values()):
        return "deleted on the durable tier after its drain had committed it there"
    return None


def remove_node_steps(steps: list[NodeStep]) -> dict[str, str]:
    """Delete the removable steps' folders; return ``{path: cause}`` of those that could not go."""
    failed = {}
    for step in steps:
        if step.removable:
            try:
                shutil.rmtree(step.path)
            except OSError as exc:
                failed[step.path] = str(exc)
    return failed


def node_copy(url: str, local_tier: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """This node's fast-tier copy of the checkpoint at ``url``: its folder, whether it holds the
    metadata, and per held file its sizes, replicas and whether the durable tier has its part."""
    path = local_step_path(local_tier, url, storage_options)
    if not os.path.isdir(path):
        return {"path": path, "present": False}
    try:
        on_durable = open_store(url, storage_options).list_sizes() or {}
    except CheckpointError:
        on_durable = None  # unreachable: said as unknown
    files = []
    for name in sorted(os.listdir(path)):
        if not name.endswith(HELD_SUFFIX):
            continue
        try:
            with open(os.path.join(path, name), "rb") as f:
                index = HeldIndex.decode(f.read())
            size = os.path.getsize(os.path.join(path, index.file))
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            files.append({"file": name.removesuffix(HELD_SUFFIX), "problem": f"unreadable: {exc}"})
            continue
        entry = {
            "file": index.file,
            "rank": parse_data_file_name(index.file).rank,
            "local_bytes": size,
            "durable_bytes": index.durable_bytes,
            "replicas": len(index.extras),
            "on_durable": None if on_durable is None else on_durable.get(index.file) == index.durable_bytes,
        }
        if size != index.local_bytes:
            entry["problem"] = f"holds {size} bytes, its index records {index.local_bytes}: read from the durable tier"
        files.append(entry)
    return {
        "path": path,
        "present": True,
        "committed_here": os.path.exists(os.path.join(path, METADATA_NAME)),
        "files": files,
    }


def _ranks_in(path: str) -> tuple[int, ...]:
    ranks = set()
    for name in os.listdir(path):
        parsed = parse_data_file_name(name.removesuffix(HELD_SUFFIX)) if name.endswith(HELD_SUFFIX) else None
        if parsed is not None:
            ranks.add(parsed.rank)
    return tuple(sorted(ranks))


def _folder_size(path: str) -> int:
    total = 0
    for entry in os.scandir(path):
        try:
            total += entry.stat().st_size if entry.is_file() else 0
        except OSError:
            pass
    return total
