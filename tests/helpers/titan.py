"""A small torchtitan training loop on spawned CPU ranks: the real ``CheckpointManager`` (ckptio's
or torchtitan's own), ``OptimizersContainer``, LR schedulers and ``ParallelAwareDataloader``, with
the tests' small model under a real parallel layout."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset
from torchtitan.components.checkpointer import CheckpointManager as TorchtitanCheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from ckptio.integrations.torchtitan import CheckpointManager
from tests.helpers.models import IN, build_model


def data_parallel(layout: str) -> tuple[int, int]:
    """This rank's (dp rank, dp size) under ``layout`` (torchtitan counts HSDP's two dims as dp)."""
    if not dist.is_initialized():
        return 0, 1
    rank, world = dist.get_rank(), dist.get_world_size()
    if layout.startswith("dp_tp:"):
        tp = int(layout.split("x")[1])
        return rank // tp, world // tp
    return rank, world


class Numbers(IterableDataset):
    """An endless stream split by dp rank: sample i of rank r holds i * dp_size + r."""

    def __init__(self, dp_rank: int, dp_size: int):
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def __iter__(self):
        for i in itertools.count():
            yield torch.full((IN,), float(i * self.dp_size + self.dp_rank))


class TrainState(Stateful):
    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


def _full(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k).replace("_orig_mod.", ""): _full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_full(v) for v in value]
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


class Run:
    """One job: build the trainer's parts, resume, train ``steps``, checkpointing on the way."""

    def __init__(
        self,
        folder: str,
        layout: str,
        *,
        manager: str = "ckptio",
        compile: bool = False,
        sd_adapter=None,
        frozen: str | None = None,
        **options,
    ):
        self.layout = layout
        self.model = build_model(layout.split("+")[0])
        for name, parameter in self.model.named_parameters():  # frozen (a fine-tune's base): no grad, no moments
            if frozen is not None and name.startswith(frozen):
                parameter.requires_grad_(False)
        parts = [torch.compile(self.model, backend="eager")] if compile else [self.model]
        self.optimizers = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
            implementation="for-loop",
        ).build(model_parts=parts)
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=20
        )
        dp_rank, dp_size = data_parallel(layout)
        self.dataloader = ParallelAwareDataloader(Numbers(dp_rank, dp_size), dp_rank, dp_size, batch_size=2)
        self.train_state = TrainState()
        config_class = CheckpointManager.Config if manager == "ckptio" else TorchtitanCheckpointManager.Config
        options = {"enable": True, "folder": folder, "interval": 2, "keep_latest_k": 0, **options}
        self.checkpointer = config_class(**options).build(
            dataloader=self.dataloader,
            model_parts=parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=sd_adapter,
        )
        self.parts = parts
        self.load_step = options.get("load_step", -1)  # what torchtitan's Trainer passes to load()
        self.batches: dict[int, float] = {}
        self.snapshots: dict[int, Any] = {}

    def snapshot(self) -> Any:
        """Everything a resume must restore, as full tensors (None except on rank 0)."""
        state = {
            "model": _full(self.parts[0].state_dict()),
            "optimizer": _full(self.optimizers.state_dict()),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "step": self.train_state.step,
        }
        return state if not dist.is_initialized() or dist.get_rank() == 0 else None

    def resume(self) -> int:
        self.checkpointer.load(step=self.load_step)
        return self.train_state.step

    def train(self, last: int) -> None:
        batches = iter(self.dataloader)
        for step in range(self.train_state.step + 1, last + 1):
            batch = next(batches)
            self.batches[step] = float(batch[0, 0])
            self.parts[0](batch).pow(2).mean().backward()
            self.optimizers.step()
            self.optimizers.zero_grad()
            self.lr_schedulers.step()
            self.train_state.step = step
            self.checkpointer.save(step)
            if step % 2 == 0:
                self.snapshots[step] = self.snapshot()
        self.checkpointer.maybe_wait_for_saving()

    def close(self) -> None:
        self.checkpointer.close()


def train_run(folder: str, layout: str, last: int, **options) -> dict:
    """Resume (if anything is there), train to step ``last``; what the run saw."""
    run = Run(folder, layout, **options)
    try:
        resumed = run.resume()
        loaded = run.snapshot()
        run.train(last)
        return {"resumed": resumed, "loaded": loaded, "snapshots": run.snapshots, "batches": run.batches}
    finally:
        run.close()


def resume_or_error(folder: str, layout: str, **options) -> dict:
    """Resume only: the restored state, or the error every rank raised."""
    run = Run(folder, layout, **options)
    try:
        resumed = run.resume()
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        run.close()
    return {"resumed": resumed, "loaded": run.snapshot(), "next_batch": float(next(iter(run.dataloader))[0, 0])}


def train_with(folder: str, layout: str, last: int, options: dict) -> dict:
    """``train_run`` with its options as one argument (``spawn`` passes positional arguments only)."""
    return train_run(folder, layout, last, **options)


def each(*calls: tuple) -> list:
    """Run several of the functions above one after the other in one spawned job."""
    return [fn(*args, **kwargs) for fn, args, kwargs in calls]


class PrefixAdapter:
    """A torchtitan state dict adapter whose Hugging Face names are the model's under ``model.``."""

    fqn_to_index_mapping = None

    def __init__(self, hf_assets_path: str | None = None):
        self.hf_assets_path = hf_assets_path

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {f"model.{k}": v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("model."): v for k, v in hf_state_dict.items()}

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False):
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        return HuggingFaceStorageReader(path)


def initial_hf_load(folder: str, layout: str, hf_url: str, storage_options: dict) -> Any:
    """A fresh job whose first load is Hugging Face weights at ``hf_url``; the model it then holds."""
    run = Run(
        folder,
        layout,
        sd_adapter=PrefixAdapter(),
        initial_load_path=hf_url,
        initial_load_in_hf=True,
        initial_load_model_only=True,
        storage_options=storage_options,
    )
    try:
        run.resume()
        return run.snapshot()
    finally:
        run.close()


def resume_counting_listings(folder: str, layout: str, storage_options: dict) -> dict:
    """``resume_or_error`` on S3, with the S3 listings this rank sent."""
    from ckptio.bench import counting

    counting.install_s3_counter()
    counting.take_counts()
    resumed = resume_or_error(folder, layout, storage_options=storage_options)
    return {**resumed, "listings": counting.take_counts()["LIST"]}
