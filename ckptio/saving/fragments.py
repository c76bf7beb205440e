"""A rank's side of a save without a coordinator: which save it belongs to, and its fragment document
(``format/fragments.py`` has the format; ``commit.publish_fragment`` the commit).

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

import hashlib
import os
import threading
import uuid
from collections import Counter

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ckptio.format.records import StoredItem
from ckptio.torch_seam import default_store

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
