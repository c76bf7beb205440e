"""``ckptio.save`` / ``ckptio.load``: dcp.save/dcp.load with ckptio storage, safe object loading,
and failures raised as ``ckptio.CheckpointError`` instead of torch's ``BaseException``."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptio.config import WriterConfig
from ckptio.errors import CheckpointError, recall_metadata_error
from ckptio.hf.reader import HFReader, report_hf_matches
from ckptio.loading.reader import Reader
from ckptio.loading.safe_load import SafeLoadPlanner
from ckptio.loading.together import fail_together
from ckptio.saving.planner import SavePlanner
from ckptio.saving.writer import Writer
from ckptio.state.keys import canonicalize, copy_back
from ckptio.state.per_rank import expand_for_save, prepare_for_load


def save(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike,
    config: WriterConfig | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    planner=None,
    process_group=None,
):
    """Save ``state_dict`` to ``checkpoint_id``; every rank of ``process_group`` must call it.

    Keys are stored canonical (no ``_orig_mod`` / ``_checkpoint_wrapped_module`` segments;
    modules given as values are expanded with ``get_model_state_dict``), ``PerRank`` values get
    one key per data-parallel rank, and the caller's dict is never modified. The default planner is
    ``ckptio.SavePlanner`` (torch's, with a linear-time plan check). ``config.use_collectives=False``
    saves without a coordinator (``WriterConfig.use_collectives``)."""
    state = expand_for_save(canonicalize(state_dict))
    writer = Writer(checkpoint_id, config, storage_options=storage_options)
    with raising_checkpoint_errors(f"save to {os.fspath(checkpoint_id)}"):
        return dcp.save(
            state,
            storage_writer=writer,
            planner=planner if planner is not None else SavePlanner(),
            process_group=process_group,
            use_collectives=writer.config.use_collectives,
        )


def load(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike | HFReader,
    *,
    storage_options: dict[str, Any] | None = None,
    planner=None,
    process_group=None,
    verify: bool = True,
    dedup_reads: bool | str = "auto",
    allow_rounding: bool = False,
) -> None:
    """Load into ``state_dict`` in place (tensors in place, objects replaced under the caller's keys).
    Objects are restored safely unless ``planner`` says otherwise; keys match canonically.
    ``dedup_reads``, ``allow_rounding``: see ``Reader``.

    ``checkpoint_id`` may be a ``ckptio.HFReader`` (Hugging Face safetensors weights): the state
    keys it holds are loaded, the others (optimizer state, step) are left as they are."""
    if isinstance(checkpoint_id, HFReader):
        return _load_hf(state_dict, checkpoint_id, planner, process_group)
    reader = Reader(
        checkpoint_id,
        storage_options=storage_options,
        verify=verify,
        dedup_reads=dedup_reads,
        allow_rounding=allow_rounding,
    )
    manifest = reader.prefetch_metadata(process_group)  # one rank reads, every rank gets it (or its error)
    state = canonicalize(state_dict)
    restore_per_rank = prepare_for_load(state, list(manifest.metadata.state_dict_metadata))
    with raising_checkpoint_errors(f"load from {os.fspath(checkpoint_id)}"):
        dcp.load(
            state,
            storage_reader=reader,
            planner=planner if planner is not None else SafeLoadPlanner(),
            process_group=process_group,
        )
    for restore in restore_per_rank:
        restore()
    copy_back(state_dict, state)


def _load_hf(state_dict: dict[str, Any], reader: HFReader, planner, process_group) -> None:
    """Hugging Face weights into the state keys they hold."""
    catalog = reader.prefetch_metadata(process_group)
    state = canonicalize(state_dict)
    try:
        report_hf_matches(state, reader.state_keys(catalog), reader.checkpoint_id)
        mismatch = None
    except CheckpointError as exc:  # each rank has its own state: one without a match must stop them all
        mismatch = exc
    fail_together(mismatch, process_group)
    with raising_checkpoint_errors(f"load from {reader.checkpoint_id}"):
        dcp.load(
            state,
            storage_reader=reader,
            planner=planner if planner is not None else SafeLoadPlanner(allow_partial_load=True),
            process_group=process_group,
        )
    copy_back(state_dict, state)


@contextlib.contextmanager
def raising_checkpoint_errors(what: str) -> Iterator[None]:
    """Turn torch's ``CheckpointException`` into the ckptio error one of the ranks raised, and
    a failed collective (a peer rank died or hung) into a ``CheckpointError`` that says so."""
    try:
        yield
    except CheckpointException as exc:
        raise unwrap(exc) from None
    except CheckpointError:
        raise
    except Exception as exc:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CheckpointError(
            f"{what} failed on rank {rank}: {type(exc).__name__}: {exc}. If another rank died or hung, look at its "
            "logs; a save that fails is never committed, and the previous checkpoint is untouched"
        ) from exc


def unwrap(exc: BaseException) -> CheckpointError:
    """The ckptio error inside torch's ``CheckpointException`` (the first failing rank's), with its
    class; any other failure becomes a ``CheckpointError`` naming the rank and the cause. A ckptio
    error (what ``ckptio.save``/``load`` raise) comes back unchanged, so one handler serves both APIs."""
    if isinstance(exc, CheckpointError):
        return exc
    if not isinstance(exc, CheckpointException):
        wrapped = CheckpointError(f"{type(exc).__name__}: {exc}")
        wrapped.__cause__ = exc
        return wrapped
    failures = exc.failures
    ranks = sorted(failures)
    others = f" (ranks that failed: {ranks})" if len(ranks) > 1 else ""
    for rank in ranks:
        error = failures[rank][0]
        # dcp.load re-raises read_metadata's error as a bare AssertionError quoting it
        found = error if isinstance(error, CheckpointError) else recall_metadata_error(str(error))
        if found is not None:
            return type(found)(f"rank {rank}: {found}{others}")
    rank = ranks[0]
    error = failures[rank][0]
    wrapped = CheckpointError(f"rank {rank}: {type(error).__name__}: {error} (ranks that failed: {ranks})")
    wrapped.__cause__ = error
    return wrapped
