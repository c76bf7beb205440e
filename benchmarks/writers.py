"""The writers compared: ckptio's modes and torch's own, each with the reader that loads it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import ckptio
from ckptio.torch_seam import FsspecReader, FsspecWriter

from . import usage_error

#: The kinds of object-store target (``__main__.targets_for``).
OBJECT_STORES = ("s3", "gcs", "azure")


@dataclass(frozen=True)
class WriterSpec:
    name: str
    targets: tuple[str, ...]  # "local", "s3", "gcs", "azure"
    make_writer: Callable[[str, dict | None], object]
    make_reader: Callable[[str, dict | None], object]
    make_planner: Callable[[], object | None] = lambda: None
    default_targets: tuple[str, ...] | None = None  # where it runs unless named with --writers (None: targets)
    save_options: dict = field(default_factory=dict)  # further dcp.save arguments
    by_default: bool = True  # False: only when named with --writers


def _ckptio(mode: str, compression: str | None = None) -> WriterSpec:
    suffix = f"+{compression}" if compression else ""
    return WriterSpec(
        f"ckptio {mode}{suffix}",
        ("local", *OBJECT_STORES),
        lambda url, opts: ckptio.Writer(
            url, ckptio.WriterConfig(mode=mode, compression=compression), storage_options=opts
        ),
        lambda url, opts: ckptio.Reader(url, storage_options=opts),
    )


def _without_coordinator(spec: WriterSpec) -> WriterSpec:
    """``spec`` saving with ``dcp.save(..., use_collectives=False)``: each rank commits its own fragment."""
    return replace(spec, name=f"{spec.name} no-coordinator", save_options={"use_collectives": False}, by_default=False)


def _torch_writer(url: str, opts: dict | None):
    if "://" in url:
        return FsspecWriter(url, **(opts or {}))
    return dcp.FileSystemWriter(url)


def _torch_reader(url: str, opts: dict | None):
    if "://" in url:
        return FsspecReader(url, **(opts or {}))
    return dcp.FileSystemReader(url)


def _torch_zstd_writer(url: str, opts: dict | None):
    from torch.distributed.checkpoint._extension import ZStandard

    return dcp.FileSystemWriter(url, _extensions=[ZStandard()])


WRITERS = [
    _ckptio("all_ranks"),
    _ckptio("replica_group"),
    _ckptio("all_ranks", "zstd"),
    _ckptio("replica_group", "zstd"),
    _without_coordinator(_ckptio("all_ranks")),
    _without_coordinator(_ckptio("replica_group")),
    WriterSpec("torch FileSystemWriter", ("local",), _torch_writer, _torch_reader),
    WriterSpec("torch FileSystemWriter+zstd", ("local",), _torch_zstd_writer, _torch_reader),
    WriterSpec(
        "torch FsspecWriter",
        ("local", *OBJECT_STORES),
        lambda url, opts: FsspecWriter(url, **(opts or {})),
        lambda url, opts: FsspecReader(url, **(opts or {})),
        default_targets=OBJECT_STORES,  # locally, FileSystemWriter is torch's writer
    ),
    WriterSpec(
        "torch dedup_save_to_lowest_rank",
        ("local", "s3"),
        _torch_writer,
        _torch_reader,
        lambda: DefaultSavePlanner(dedup_save_to_lowest_rank=True),
        default_targets=("s3",),  # replica_group's peer where object counts matter
    ),
]


def select(names: list[str] | None, compressed: bool) -> list[WriterSpec]:
    """The writers to run, each with the targets to run it on: writers named in ``names`` on all of
    theirs; by default every writer (the +zstd ones with ``compressed``) on its default targets."""
    chosen = [
        replace(w, targets=w.default_targets or w.targets)
        for w in WRITERS
        if w.by_default and (compressed or "zstd" not in w.name)  # --compressed adds every +zstd writer
    ]
    if names:
        wanted = {n.lower() for n in names}
        chosen = [w for w in WRITERS if w.name.lower() in wanted or w.name.split()[-1].lower() in wanted]
        unknown = wanted - {w.name.lower() for w in chosen} - {w.name.split()[-1].lower() for w in chosen}
        if unknown:
            usage_error(f"unknown writer(s) {sorted(unknown)}; choose from {[w.name for w in WRITERS]}")
    return chosen
