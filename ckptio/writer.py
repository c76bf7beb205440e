"""The DCP StorageWriter: plan -> encode -> store -> commit.

Each writing rank streams its items, block by block, into one data file; the coordinator
publishes ``ckptio.json`` only after every rank's file is durable, so a checkpoint is
loadable exactly when it is complete.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from . import __version__
from .codec import BlockEncoder, block_size_for, checksum
from .config import WriterConfig
from .errors import CheckpointError, CheckpointExistsError, CheckpointFormatError, CheckpointNotFoundError, StorageError
from .layout import METADATA_NAME, StoredItem, data_file_name, decode_metadata, dtype_name, encode_metadata
from .location import CheckpointLocation
from .objects import REPORT_KEY, ObjectReport, mesh_of, per_rank_values
from .planning import Holdings, assign_writers
from .storage import FsspecStore

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RankAssignment:
    """What the coordinator tells each rank: this save's id and the file it writes (if any)."""

    save_id: str
    file: str | None
    private_only: bool = False


class Writer(CheckpointLocation, StorageWriter):
    """Save a DCP checkpoint to any fsspec URL.

    Example::

        dcp.save(state, storage_writer=ckptio.Writer("s3://bucket/run/step-100",
                                                     ckptio.WriterConfig(mode="replica_group")))
    """

    _role = ("Writer", "dcp.save")

    def __init__(
        self,
        checkpoint_id: str | os.PathLike | None = None,
        config: WriterConfig | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.config = config if config is not None else WriterConfig()
        self.storage_options = dict(storage_options or {})
        self.checkpoint_id: str | None = None
        self.rank = 0
        self.is_coordinator = True
        self.reset(checkpoint_id)

    # --- DCP protocol -----------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        # storage_options survive reset: torch's FsspecWriter drops them here and silently
        # falls back to the default endpoint.
        if checkpoint_id is not None:
            self.checkpoint_id = os.fspath(checkpoint_id)
        self._store: FsspecStore | None = None
        self._superseded: list[str] = []
        self._save_id: str | None = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.rank = rank

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id) if self.checkpoint_id else None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._open_store().prepare_directory()
        self._held_objects = [it for it in plan.items if it.type == WriteItemType.BYTE_IO]
        return dataclasses.replace(plan, storage_data=Holdings(self.rank, tuple(plan.items)))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._check_target()
        save_id = uuid.uuid4().hex[:16]
        assigned = assign_writers(plans, self.config.mode)
        return [
            dataclasses.replace(
                plan, items=a.items, storage_data=RankAssignment(save_id, data_file_name(save_id, rank), a.private_only)
            )
            for rank, (plan, a) in enumerate(zip(plans, assigned))
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assignment: RankAssignment = plan.storage_data
        self._save_id = assignment.save_id
        # Every object this rank holds is pickled once: to compare it with the other ranks' values
        # under the same key, and (if this rank writes it) to store it.
        objects = {it.index: planner.resolve_data(it).getbuffer() for it in self._held_objects}
        report = ObjectReport(
            self.rank,
            {idx.fqn: (checksum(buf), len(buf)) for idx, buf in objects.items()},
            mesh=mesh_of(getattr(planner, "state_dict", None)),
        )
        keep_per_rank = self.config.differing_objects == "keep_per_rank"
        assigned = {it.index for it in plan.items}
        # keep_per_rank: every rank also stores its own copy of the objects another rank writes.
        extras = [it for it in self._held_objects if it.index not in assigned] if keep_per_rank else []
        results: list[WriteResult] = []
        if plan.items or extras:
            inline_limit = self.config.inline_limit if assignment.private_only and not extras else 0
            results, stored_objects = self._write_file(
                assignment.file, plan.items + extras, planner, objects, inline_limit
            )
            if keep_per_rank:
                report.copies = stored_objects
            results = [r for r in results if r.index in assigned]
        results.append(WriteResult(index=MetadataIndex(REPORT_KEY), size_in_bytes=0, storage_data=report))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        reports = [r.storage_data for rank_results in results for r in rank_results if r.index.fqn == REPORT_KEY]
        results = [[r for r in rank_results if r.index.fqn != REPORT_KEY] for rank_results in results]
        per_rank = per_rank_values(reports, self.config.differing_objects)
        files, writers = _data_files(results, reports)
        header = {
            "written_by": f"ckptio {__version__}",
            "torch_version": torch.__version__,
            "created_unix": time.time(),
            "save_id": self._save_id,
            "world_size": len(results),
            "mesh": next((r.mesh for r in reports if r.mesh), None),
            "config": {k: getattr(self.config, k) for k in ("mode", "compression", "max_block_size")},
            "files": files,
            "writer_ranks": writers,
            "per_rank_objects": {
                key: {str(rank): item.to_json() for rank, item in copies.items()} for key, copies in per_rank.items()
            },
        }
        items = {r.index: r.storage_data for rank_results in results for r in rank_results}
        store = self._open_store()
        store.put_atomic(METADATA_NAME, encode_metadata(metadata, items, header))
        stale = [name for name in self._superseded if name not in files]
        if stale:
            store.delete(stale)

    def _check_target(self) -> None:
        """Refuse to replace a committed checkpoint unless asked; remember what an overwrite supersedes."""
        store = self._open_store()
        try:
            old = store.read(METADATA_NAME)
        except FileNotFoundError:
            return
        except CheckpointNotFoundError as exc:  # e.g. no such bucket: nowhere to save to
            raise StorageError(f"cannot save to {self.checkpoint_id}: {exc}") from None
        if not self.config.overwrite:
            raise CheckpointExistsError(
                f"{store.describe(METADATA_NAME)} already holds a committed checkpoint; save to a new path, "
                "or pass WriterConfig(overwrite=True) to replace it "
                "(the old one stays loadable until the new one commits)"
            )
        try:
            self._superseded = sorted(decode_metadata(old, store.describe(METADATA_NAME)).files)
        except CheckpointFormatError as exc:
            log.warning("ckptio: overwriting an unreadable checkpoint; its data files are left in place: %s", exc)

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner, objects: dict, inline_limit: int
    ) -> tuple[list[WriteResult], dict[str, StoredItem]]:
        """Write ``items`` to ``name`` (or inline); return their results and the object records by key."""
        config = self.config
        encoder = BlockEncoder(
            config.max_block_size, config.compression, config.compression_level, config.max_concurrency
        )
        sink = _InlineOrFileSink(self._open_store(), name, inline_limit)
        results: list[WriteResult] = []
        offset = 0
        try:
            # Objects first: they are small, and their pickling is the likeliest thing to fail.
            for item in sorted(items, key=lambda it: it.type != WriteItemType.BYTE_IO):
                if item.index in objects:
                    data, kind, dtype, shape = objects[item.index], "bytes", None, None
                else:
                    data, kind, dtype, shape = _item_bytes(item, planner.resolve_data(item))
                block_size = block_size_for(len(data), encoder.max_block_size)
                blocks = []
                for stored, crc in encoder.encode(data, block_size):
                    sink.write(stored)
                    blocks.append((len(stored), crc))
                record = StoredItem(
                    name, offset, len(data), kind, dtype, shape, encoder.codec, block_size, tuple(blocks)
                )
                offset += record.stored_bytes
                results.append(WriteResult(index=item.index, size_in_bytes=record.stored_bytes, storage_data=record))
            sink.close()
        except BaseException:
            sink.abort()
            raise
        finally:
            encoder.close()
        if sink.inline is not None:
            results = [
                dataclasses.replace(
                    r,
                    storage_data=dataclasses.replace(
                        r.storage_data,
                        file="",
                        offset=0,
                        inline=sink.inline[r.storage_data.offset : r.storage_data.offset + r.storage_data.stored_bytes],
                    ),
                )
                for r in results
            ]
        return results, {r.index.fqn: r.storage_data for r in results if r.storage_data.kind == "bytes"}


def _data_files(results: list[list[WriteResult]], reports: list[ObjectReport]) -> tuple[dict, dict]:
    """Size and writing rank of every data file, from the records of everything written."""
    written: dict[tuple[str, int], tuple[StoredItem, int]] = {}  # (file, offset) -> record, rank
    for rank, rank_results in enumerate(results):
        for r in rank_results:
            written[(r.storage_data.file, r.storage_data.offset)] = (r.storage_data, rank)
    for report in reports:  # keep_per_rank copies; a rank's assigned objects are in both lists
        for item in report.copies.values():
            written[(item.file, item.offset)] = (item, report.rank)
    files: dict[str, int] = {}
    writers: dict[str, int] = {}
    for (name, _), (item, rank) in written.items():
        if name:  # "" = inline in ckptio.json
            files[name] = files.get(name, 0) + item.stored_bytes
            writers[name] = rank
    return files, writers


class _InlineOrFileSink:
    """Holds up to ``limit`` bytes in memory; past that, streams to the real data file.
    If the limit is never crossed, ``inline`` holds everything and no file is created."""

    def __init__(self, store: FsspecStore, name: str, limit: int):
        self.store, self.name, self.limit = store, name, limit
        self.buffer: bytearray | None = bytearray() if limit > 0 else None
        self.sink = None if limit > 0 else store.open_sink(name)
        self.inline: bytes | None = None

    def write(self, data) -> None:
        if self.buffer is not None and len(self.buffer) + len(data) <= self.limit:
            self.buffer += data
            return
        if self.sink is None:
            self.sink = self.store.open_sink(self.name)
            self.sink.write(self.buffer)
            self.buffer = None
        self.sink.write(data)

    def close(self) -> None:
        if self.sink is None:
            self.inline = bytes(self.buffer)
        else:
            self.sink.close()

    def abort(self) -> None:
        if self.sink is not None:
            self.sink.abort()


def _item_bytes(item: WriteItem, data: Any) -> tuple[memoryview, str, str | None, tuple[int, ...] | None]:
    if item.type == WriteItemType.BYTE_IO:
        return data.getbuffer(), "bytes", None, None
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    expected = tuple(item.tensor_data.chunk.sizes)
    if tuple(tensor.shape) != expected:
        raise CheckpointError(
            f"key {item.index.fqn!r}: the planner resolved a tensor of shape {tuple(tensor.shape)} "
            f"for a chunk of shape {expected}"
        )
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(raw).cast("B"), "tensor", dtype_name(tensor.dtype), expected
