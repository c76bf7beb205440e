"""torchtitan: a ``CheckpointManager`` that saves and loads with ckptio.

Change the checkpoint line of a trainer config (tested with torchtitan 0.3)::

    from ckptio.integrations.torchtitan import CheckpointManager
    checkpoint=CheckpointManager.Config(enable=True, interval=500, save_mode="replica_group")

Everything else is torchtitan's own manager: its save policy, async modes (their process group
and stager), Hugging Face export. What differs:

- saves go through ``ckptio.Writer`` (atomic commit, checksums, ``save_mode``, compression);
- resume finds the newest committed ``step-N`` folder, whether ckptio wrote it or torch DCP did
  before the switch (loaded with torch's reader), and never an unfinished one;
- a resume on another data-parallel size fails naming both sizes, unless
  ``dataloader_on_resize="skip"`` restarts the data loaders;
- ``keep_latest_k`` deletes an old checkpoint whole, its commit marker first;
- Hugging Face initial loads (``initial_load_in_hf``) read through ``ckptio.HFReader``: from any
  fsspec URL, ``s3://`` included (torch's reader opens local paths only), each rank reading
  only its slices; quantized checkpoints keep the model's own reader.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import re
import threading
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpointer.base import DATALOADER, MODEL, purge_thread
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.components.checkpointer.dcp import CheckpointManager as TorchtitanCheckpointManager
from torchtitan.tools.utils import GarbageCollection

from ckptio.api import raising_checkpoint_errors
from ckptio.config import WriterConfig
from ckptio.errors import CheckpointNotFoundError, PerRankStateError
from ckptio.format.names import METADATA_NAME, TORCH_DCP_METADATA_NAME
from ckptio.hf.reader import HFReader
from ckptio.loading.read_once import read_once
from ckptio.loading.reader import Reader
from ckptio.saving.planner import SavePlanner
from ckptio.saving.writer import Writer
from ckptio.storage import open_store
from ckptio.tiers.latest import latest
from ckptio.tiers.writing import local_commit_exists
from ckptio.tools.cleanup import checkpoint_format, delete_checkpoint
from ckptio.tools.convert import torch_dcp_reader

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)

_STEP_FOLDER = re.compile(r"step-(\d+)")
_SAVED_DP_RANK = re.compile(rf"{DATALOADER}\.dp_rank_(\d+)")


class CheckpointManager(TorchtitanCheckpointManager):
    """torchtitan's ``CheckpointManager`` with ckptio as its storage layer."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(TorchtitanCheckpointManager.Config):
        save_mode: Literal["all_ranks", "replica_group"] = "all_ranks"
        """ckptio save mode: every rank writes its own file (``all_ranks``), or only the first replica
        group writes (``replica_group``: fewer, larger files; for HSDP on object stores)."""

        compression: Literal["none", "zstd"] = "none"
        """Per-block zstd where it shrinks the data (``zstd``), or raw bytes."""

        overwrite: bool = True
        """Replace a committed checkpoint of the same step, as torch's writer does (a run resumed from
        an earlier ``load_step`` saves those steps again); the old one stays loadable until the new
        one commits. ``False`` fails such a save instead."""

        writer_options: dict[str, Any] = dataclasses.field(default_factory=dict)
        """Further ``ckptio.WriterConfig`` fields by name, as ``WriterConfig.from_dict`` takes them
        (``{"local_tier": ..., "storage_config": {"part_size": ..., "max_concurrency": ...}}``)."""

        storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
        """fsspec options for the checkpoint folder (an S3 endpoint, credentials)."""

        dataloader_on_resize: Literal["error", "skip"] = "error"
        """Resuming on another data-parallel size: ``error`` fails naming both sizes; ``skip``
        restarts the data loaders (model, optimizer, schedule and step are still restored)."""

        def __post_init__(self) -> None:
            # torchtitan refuses Hugging Face initial loads from remote URLs, because torch's HF reader
            # opens local paths only; ckptio.HFReader reads any fsspec URL, so only its own checks apply.
            path = self.initial_load_path
            remote_hf = self.initial_load_in_hf and not self.initial_load_in_hf_quantized and path and "://" in path
            if remote_hf:
                self.initial_load_path = "/"
            try:
                TorchtitanCheckpointManager.Config.__post_init__(self)
            finally:
                self.initial_load_path = path
            if self.dataloader_on_resize not in ("error", "skip"):
                raise ValueError(f"dataloader_on_resize must be 'error' or 'skip', got {self.dataloader_on_resize!r}")
            self.writer_config()  # unknown or invalid writer options fail here, not at the first save

        def writer_config(self) -> WriterConfig:
            options = {
                "mode": self.save_mode,
                "compression": None if self.compression == "none" else self.compression,
                "overwrite": self.overwrite,
            }
            clash = sorted(set(options) & set(self.writer_options))
            if clash:
                raise ValueError(f"set {clash} as checkpoint fields of their own, not in writer_options")
            return WriterConfig.from_dict({**options, **self.writer_options})

    def __init__(self, config: Config, **components: Any) -> None:
        # torchtitan's purge thread deletes with a plain recursive remove; start ours instead.
        super().__init__(dataclasses.replace(config, keep_latest_k=0), **components)
        if not self.enable:
            return
        self.writer_config = config.writer_config()
        self.storage_options = dict(config.storage_options)
        self.dataloader_on_resize = config.dataloader_on_resize
        self.keep_latest_k = config.keep_latest_k
        self._saving_step = -1
        if self.keep_latest_k > 0:
            self.purge_queue = queue.Queue()
            self.purge_thread = threading.Thread(
                target=purge_thread, args=(self.purge_queue, self._delete), name="ckptio-purge", daemon=True
            )
            self.purge_thread.start()

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        self._saving_step = curr_step
        return TorchtitanCheckpointManager._save(self, curr_step, last_step)

    def _purge_stale_checkpoints(self) -> None:
        """Queue all but the newest ``keep_latest_k`` step folders for deletion, counting the save
        just started (an async save may not have created its folder yet; object stores have none)."""
        if self.keep_latest_k <= 0 or dist.get_rank() != 0:
            return
        steps = set(self._step_folders(self.folder)) | {self._saving_step}
        for step in sorted(steps)[: -self.keep_latest_k]:
            self.purge_queue.put(self._create_checkpoint_id(step))

    def _step_folders(self, folder: str) -> list[int]:
        names = open_store(folder, self.storage_options).list_names(strict=True) or []
        return sorted((int(m.group(1)) for n in names if (m := _STEP_FOLDER.fullmatch(n))), reverse=True)

    def _delete(self, url: str) -> None:
        delete_checkpoint(open_store(url, self.storage_options))

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ):
        if to_hf:  # Hugging Face export stays torch's HuggingFaceStorageWriter
            return TorchtitanCheckpointManager.dcp_save(
                self, state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        writer = Writer(checkpoint_id, self.writer_config, storage_options=self.storage_options)
        planner = SavePlanner()
        collectives = self.writer_config.use_collectives
        if async_mode == AsyncMode.ASYNC:
            result = dcp.async_save(
                state_dict, storage_writer=writer, planner=planner, process_group=self.pg, use_collectives=collectives
            )
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            result = dcp.async_save(
                state_dict,
                storage_writer=writer,
                planner=planner,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
                use_collectives=collectives,
            )
        else:
            with raising_checkpoint_errors(f"saving {checkpoint_id}"):
                result = dcp.save(state_dict, storage_writer=writer, planner=planner, use_collectives=collectives)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf and from_quantized:  # the model's own quantized reader (dequantizes on load)
            return TorchtitanCheckpointManager.dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized)
        if from_hf:
            self._load_hf(state_dict, checkpoint_id)
            return
        tier = self.writer_config.local_tier
        if tier and local_commit_exists(self.writer_config, checkpoint_id, self.storage_options):
            found = "ckptio"  # a tiered save, perhaps not yet drained: the fast tier holds its metadata
        else:
            found = checkpoint_format(open_store(checkpoint_id, self.storage_options))
        if found == "ckptio":
            reader = Reader(checkpoint_id, storage_options=self.storage_options, local_tier=tier)
        elif found == "torch_dcp":
            log.info("ckptio: %s was written by torch DCP; loading it with torch's reader", checkpoint_id)
            reader = torch_dcp_reader(checkpoint_id, self.storage_options)
        else:
            raise CheckpointNotFoundError(
                f"{checkpoint_id} holds no committed checkpoint (no {METADATA_NAME} and no torch "
                f"{TORCH_DCP_METADATA_NAME}); a save there never finished. Resume from another step "
                "(checkpoint.load_step) or remove the folder"
            )
        with raising_checkpoint_errors(f"loading {checkpoint_id}"):
            if isinstance(reader, Reader):  # read once: dcp.load below uses the prefetched metadata
                saved_keys = set(reader.prefetch_metadata(process_group=None).metadata.state_dict_metadata)
            else:
                saved_keys = set(reader.read_metadata().state_dict_metadata)
            self._apply_dataloader_policy(state_dict, saved_keys, checkpoint_id)
            dcp.load(state_dict, storage_reader=reader)
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    def _load_hf(self, state_dict: dict[str, Any], checkpoint_id: str) -> None:
        """Hugging Face weights through ``ckptio.HFReader``: any fsspec URL (``s3://`` included, with
        this manager's ``storage_options``), each rank reading only its slices."""
        if self.sd_adapter is None:
            raise ValueError("loading Hugging Face safetensors needs the model's state dict adapter (sd_adapter)")
        hf_state_dict = self.sd_adapter.to_hf(state_dict)
        reader = HFReader(checkpoint_id, storage_options=self.storage_options)
        with raising_checkpoint_errors(f"loading Hugging Face weights from {checkpoint_id}"):
            dcp.load(hf_state_dict, storage_reader=reader)
        self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf_state_dict))

    def _apply_dataloader_policy(self, state_dict: dict[str, Any], saved_keys: set[str], checkpoint_id: str) -> None:
        """torchtitan stores one ``dataloader.dp_rank_<r>`` per data-parallel rank; on another
        data-parallel size those cannot be matched one to one. Fail naming the sizes, or drop the
        data loader from the load (``skip``)."""
        loader = state_dict.get(DATALOADER)
        dp_size = getattr(loader, "dp_world_size", None)
        if loader is None or dp_size is None:
            return
        saved = sorted(int(m.group(1)) for key in saved_keys if (m := _SAVED_DP_RANK.fullmatch(key)))
        if saved == list(range(dp_size)):
            return
        if not saved:
            what = "holds no data loader state"
        elif saved == list(range(len(saved))):
            what = f"was saved by {len(saved)} data-parallel ranks"
        else:
            what = f"holds data loader state of data-parallel ranks {saved} only"
        if self.dataloader_on_resize == "skip":
            log.warning(
                "ckptio: %s %s and this job has %d; dataloader_on_resize='skip': the data loaders start afresh",
                checkpoint_id,
                what,
                dp_size,
            )
            del state_dict[DATALOADER]
            return
        raise PerRankStateError(
            f"{checkpoint_id} {what}, but this job has {dp_size} data-parallel ranks, so the saved data "
            "positions cannot be matched one to one (key dataloader.dp_rank_<r>). Resume with the saved "
            "data-parallel size, set checkpoint.dataloader_on_resize='skip' to restart the data loaders "
            "(model, optimizer, lr schedule and step are still restored), or add 'dataloader' to "
            "checkpoint.exclude_from_loading"
        )

    def _find_load_step(self, folder: str = "") -> int:
        """The newest ``step-N`` that holds a committed checkpoint (ckptio, torch DCP or Hugging
        Face), or -1, agreed by all ranks: one rank looks (a listing and a few existence checks,
        newest first) and tells the others, so a job of thousands of ranks lists the folder once."""
        folder = folder or self.folder
        tier = self.writer_config.local_tier
        if tier:  # the newest step every rank can load from either tier, agreed by all ranks
            url = latest(folder, local_tier=tier, storage_options=self.storage_options)
            return int(url.rsplit("step-", 1)[1]) if url else -1
        return read_once(lambda: self._newest_committed_step(folder), None, folder)

    def _newest_committed_step(self, folder: str) -> int:
        steps = self._step_folders(folder)
        for step in steps:
            if checkpoint_format(open_store(self._create_checkpoint_id(step, folder), self.storage_options)):
                if step != steps[0]:
                    log.warning("ckptio: skipping unfinished checkpoints newer than step %d in %s", step, folder)
                return step
        if steps:
            log.warning("ckptio: %s has step folders %s but none holds a committed checkpoint", folder, steps[:5])
        return -1
