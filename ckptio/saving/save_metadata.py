"""What a save commits: the records of its written items, its files and their writers, its header and
chain record, and the check that the document loads before it is committed."""

from __future__ import annotations

import itertools
import logging
import operator
import time
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ckptio.config import WriterConfig
from ckptio.errors import CheckpointError, CheckpointFormatError
from ckptio.format.document import decode_metadata
from ckptio.format.names import SIBLING_PREFIX
from ckptio.format.records import (
    VIRTUAL_PREFIX,
    ChainRecord,
    Header,
    MeshRecord,
    Reference,
    SavedConfig,
    StoredItem,
)
from ckptio.saving.consistency import ObjectReport
from ckptio.saving.incremental import Base
from ckptio.saving.planning import Holdings
from ckptio.version import __version__

log = logging.getLogger(__name__)


def refuse_unloadable(document: bytes, where: str, decode: Callable[[bytes, str], Any] = decode_metadata) -> None:
    """A save that reports success must load: its metadata goes through the decoder every load uses
    before it is committed, so a rule the encoder missed fails the save, not a later restart."""
    try:
        decode(document, where)
    except CheckpointFormatError as exc:
        raise CheckpointError(
            f"this save's metadata would not load, so the save was not committed: {exc}. The state holds "
            "something ckptio cannot store; please report it with the state's key layout"
        ) from None


def header_of(
    config: WriterConfig,
    metadata: Metadata,
    files: dict[str, int],
    writers: dict[str, int],
    mesh: MeshRecord | None,
    save_id: str | None,
    world_size: int,
) -> Header:
    return Header(
        files=files,
        written_by=f"ckptio {__version__}",
        torch_version=torch.__version__,
        created_unix=time.time(),
        save_id=save_id,
        world_size=world_size,
        mesh=mesh,
        config=SavedConfig(config.mode, config.compression, config.tuning.max_block_size),
        writer_ranks=writers,
        dcp_version=metadata.version,
    )


def chain_of(base: Base | None, config: WriterConfig, items: Any) -> ChainRecord:
    """The chain record of an incremental save's metadata. A rank referenced a base the coordinator did
    not resolve only if the base changed during the save: the depth is then taken as the bound's, so
    the next save is a full one."""
    items = list(items)
    referenced = sum(
        run.length
        for item in items
        if isinstance(item, Reference)
        for run in item.extents
        if run.file.startswith(SIBLING_PREFIX)
    )
    stored = sum(item.stored_bytes for item in items)
    if base is None:
        log.warning("ckptio: ranks of this save resolved different incremental bases; the next save will be full")
        return ChainRecord("unknown", config.tuning.incremental_max_depth, referenced, stored)
    return ChainRecord(base.name, base.depth, referenced, stored)


def check_same_location(plans: list[SavePlan]) -> None:
    """Every rank must save to the same checkpoint: files split across paths never load."""
    locations: dict[str | None, list[int]] = {}
    for rank, plan in enumerate(plans):
        if isinstance(plan.storage_data, Holdings):
            locations.setdefault(plan.storage_data.checkpoint_id, []).append(rank)
    if len(locations) > 1:
        shown = "; ".join(
            f"ranks {ranks[:8]}{' ...' if len(ranks) > 8 else ''}: {url!r}" for url, ranks in locations.items()
        )
        raise CheckpointError(
            f"the ranks were given different checkpoint locations ({shown}); every rank must save to the same "
            "path. Build the path once (e.g. on rank 0) and share it, instead of from a per-rank clock or value"
        )


def written(
    results: list[list[WriteResult]], reports: list[ObjectReport]
) -> tuple[dict[tuple[str, torch.Size | None], StoredItem], dict[str, int], dict[str, int]]:
    """The record of every written item by ``(key, chunk offsets or None)``, and the size and writing
    rank of every data file (a rank's results name distinct bytes of its own file). C-level passes
    over the results: at thousands of ranks a Python loop over every result was a fifth of the finish."""
    every = list(itertools.chain.from_iterable(results))
    stored = list(map(_STORAGE_DATA, every))
    items = dict(zip(map(_INDEX_KEY, every), stored, strict=True))
    names = list(map(_FILE, stored))
    files: dict[str, int] = {}
    for name, size in zip(names, map(_STORED_BYTES, stored), strict=True):
        files[name] = files.get(name, 0) + size
    ranks = list(itertools.chain.from_iterable(map(itertools.repeat, range(len(results)), map(len, results))))
    writers = dict(zip(names, ranks, strict=True))
    if any(name.startswith((SIBLING_PREFIX, VIRTUAL_PREFIX)) for name in files):
        _count_references(stored, ranks, files, writers)
    if any(report.copies for report in reports):  # keep_per_rank: a rank's assigned objects are in both lists
        counted = {(item.file, item.offset) for item in stored}
        for report in reports:
            for item in report.copies.values():
                if (item.file, item.offset) not in counted:
                    counted.add((item.file, item.offset))
                    files[item.file] = files.get(item.file, 0) + item.stored_bytes
                    writers[item.file] = report.rank
    files.pop("", None)  # inline in ckptio.json
    writers.pop("", None)
    return items, files, writers


def _count_references(
    stored: list[StoredItem], ranks: list[int], files: dict[str, int], writers: dict[str, int]
) -> None:
    """The data files of an incremental save's references (``records.Reference``): a sibling's has the
    size recorded there and the writer its name gives; an item stored in pieces counts its own runs in
    the rank's file, and its virtual name is no file."""
    for item, rank in zip(stored, ranks, strict=True):
        if not isinstance(item, Reference):
            continue
        if item.file.startswith(VIRTUAL_PREFIX):
            files.pop(item.file, None)
            writers.pop(item.file, None)
            for run in item.extents:
                if not run.file.startswith(SIBLING_PREFIX):
                    files[run.file] = files.get(run.file, 0) + run.length
                    writers[run.file] = rank
        for name, size in item.sibling_sizes:
            files[name] = size
            writers.pop(name, None)


def with_records(
    results: list[list[WriteResult]], replacements: list[dict[MetadataIndex, StoredItem] | None]
) -> list[list[WriteResult]]:
    """Every rank's write results with the records its ``replacements`` (``None``: none) give in place."""
    out = []
    for rank_results, records in zip(results, replacements, strict=True):
        records = records or {}
        out.append(
            [
                WriteResult(r.index, records[r.index].stored_bytes, records[r.index]) if r.index in records else r
                for r in rank_results
            ]
        )
    return out


_STORAGE_DATA = operator.attrgetter("storage_data")
_INDEX_KEY = operator.attrgetter("index.fqn", "index.offset")
_FILE = operator.attrgetter("file")
_STORED_BYTES = operator.attrgetter("stored_bytes")
