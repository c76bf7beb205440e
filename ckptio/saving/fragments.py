"""A rank's side of a save without a coordinator: which save it belongs to, what it writes alone, and its
fragment document (``format/fragments.py`` has the format; the Writer's landing commits it).

The ranks of one save must name it alike without exchanging a message, and two saves to one path
must differ, even when a job is restarted or requeued and saves the same step again: a requeued
attempt's fragments must never complete an earlier attempt's set. A save's id is a hash of the
checkpoint URL, the attempt's identity, and how many saves without a coordinator to that URL this
process made before. The attempt's identity is a token that the first rank to ask leaves in torch's
rendezvous store (one store request per process, never one per save; the store is new for every
attempt: torchrun keeps one per restart), joined to ``CKPTIO_JOB_ID`` when set; a single process
(no store to share) takes a fresh random one. Only where the ranks share no store does
``CKPTIO_JOB_ID`` alone name the save, and it must then differ between attempts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import threading
import uuid
from collections import Counter
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ckptio.errors import CheckpointError
from ckptio.format.document import decode_fragment, encode_metadata
from ckptio.format.fragments import FragmentInfo, Replica, Replicas
from ckptio.format.names import SIBLING_PREFIX, fragment_name
from ckptio.format.records import MeshRecord, StoredItem
from ckptio.saving.data_file import pickled_objects
from ckptio.saving.incremental import note_saved
from ckptio.saving.references import by_sibling, mark_references
from ckptio.saving.replicas import own_writes
from ckptio.saving.save_metadata import chain_of, header_of, refuse_unloadable, written
from ckptio.state.keys import canonical_planner_data
from ckptio.torch_seam import default_store, enclosing_save_wrapper

_JOB_KEY = "ckptio/job-token"
_lock = threading.Lock()
_job_token: str | None = None
_saves_to: Counter = Counter()


def fragment_save_id(checkpoint_id: str) -> str:
    """This save's id, the same on every rank of the job (each rank calls this once per save)."""
    with _lock:
        _saves_to[checkpoint_id] += 1
        count = _saves_to[checkpoint_id]
    text = f"{job_token()}\n{checkpoint_id}\n{count}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def job_token() -> str:
    """This attempt's identity (the module's rule), the same on every rank of the attempt."""
    global _job_token
    with _lock:
        if _job_token is None:
            job = os.environ.get("CKPTIO_JOB_ID")
            attempt = _store_token()
            if attempt is None and (job is None or not _several_ranks()):
                attempt = uuid.uuid4().hex
            _job_token = "\n".join(part for part in (job, attempt) if part is not None)
        return _job_token


def _several_ranks() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _store_token() -> str | None:
    """The token in the default process group's store, left there by the first rank that asked."""
    if not _several_ranks():
        return None
    try:
        store = default_store()
        return store.compare_set(_JOB_KEY, "", uuid.uuid4().hex).decode()
    except (AttributeError, RuntimeError, ValueError):  # another torch, or a store without compare_set
        return None


def fragment_metadata(metadata: Metadata, items: dict[tuple, StoredItem]) -> Metadata:
    """The DCP metadata of what this rank wrote: ``metadata`` (everything it holds, as torch planned it
    for this rank alone) less the chunks another rank writes."""
    state = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            if (fqn, None) in items:
                state[fqn] = md
            continue
        chunks = [c for c in md.chunks if (fqn, c.offsets) in items]
        if chunks:
            state[fqn] = TensorStorageMetadata(md.properties, md.size, chunks)
    planner_data = metadata.planner_data
    if isinstance(planner_data, dict):
        planner_data = {fqn: path for fqn, path in planner_data.items() if fqn in state}
    fragment = Metadata(state_dict_metadata=state, planner_data=planner_data)
    fragment.version = metadata.version
    return fragment


@dataclasses.dataclass
class FragmentSave:
    """A rank's part in a save without a coordinator: the save's id (the same on every rank), how many
    ranks save, and what ``write_data`` found for the fragment."""

    save_id: str
    ranks: int
    members: tuple[int, ...] | None = None  # the save's group: global ranks by group rank (None: every rank)
    replicas: list[Replica] = dataclasses.field(default_factory=list)
    mesh: MeshRecord | None = None


def fragment_of_save(writer: Any) -> FragmentSave:
    """This rank's place in a save without a coordinator, or a clear refusal."""
    if not dist.is_initialized():
        return FragmentSave(fragment_save_id(writer.checkpoint_id), 1)
    wrapper = enclosing_save_wrapper(sys._getframe(1))  # torch hands the writer its rank, not its group
    if wrapper is None and writer.rank != dist.get_rank():
        raise CheckpointError(
            f"ckptio cannot tell the process group of this save without collectives (this rank is {writer.rank} "
            f"of the save's group and {dist.get_rank()} of the default one, and torch's dcp.save frame was not "
            "found): save over the default process group"
        )
    group = getattr(wrapper, "group", None)
    members = None if group is None else tuple(dist.get_process_group_ranks(group))
    return FragmentSave(fragment_save_id(writer.checkpoint_id), dist.get_world_size(group), members)


def write_own_part(
    writer: Any, file: str, held: dict[MetadataIndex, WriteItem], planner: SavePlanner
) -> list[WriteResult]:
    """Write what this rank decides alone to write (``replicas.py``): its chunks no other rank writes, and
    its own copy of every object and plain tensor; what it holds besides are its replicas."""
    save = writer._fragment
    state = getattr(planner, "state_dict", None) or {}
    own = own_writes(held, state, writer.rank, writer.config.mode, save.members)
    save.replicas, save.mesh = own.replicas, MeshRecord.of(state)
    if own.written:  # against this rank's own resolve of the base (the same checkpoint on every rank)
        writer._base = writer.incremental_base()
    replicas = {k: v for k, v in held.items() if k not in own.written}
    objects = pickled_objects(held, planner)
    stored = writer._landing.write(file, own.written, replicas, planner, objects, writer.config.tuning.inline_limit)
    note_saved(writer.checkpoint_id)
    return [WriteResult(index, record.stored_bytes, record) for index, record in stored.items()]


def commit_fragment(writer: Any, metadata: Metadata, results: list[WriteResult]) -> None:
    """Commit this rank's fragment; the save is loadable once every rank's is there."""
    save, rank = writer._fragment, writer.rank
    items, files, _ = written([results], [])
    writers = {name: rank for name in files if not name.startswith(SIBLING_PREFIX)}  # a sibling's: its name's
    header = header_of(writer.config, metadata, files, writers, save.mesh, save.save_id, world_size=save.ranks)
    if by_sibling(files):  # this rank's part of the chain; the merge joins the ranks' parts
        header = dataclasses.replace(header, chain=chain_of(writer._base, writer.config, items.values()))
    metadata.planner_data = canonical_planner_data(metadata.planner_data)
    info = FragmentInfo(save.save_id, rank, save.ranks, Replicas.of(save.replicas))
    document = encode_metadata(fragment_metadata(metadata, items), items, header, fragment=info)
    name = fragment_name(rank, save.ranks)
    store = writer._open_store()
    refuse_unloadable(document, store.describe(name), decode_fragment)
    if header.chain is not None:
        mark_references(store, files, save.save_id, rank, writer._landing.pending_s)
    writer._landing.commit_fragment(name, document, files, (save.save_id, save.ranks) if rank == 0 else None)
