"""``ckptio verify``: read every stored block of a checkpoint and check its size and checksum."""

from __future__ import annotations

from typing import Callable

from ckptio.errors import CheckpointError, CorruptCheckpointError
from ckptio.format.records import Manifest
from ckptio.loading.extents import byte_source
from ckptio.loading.fetch import read_item_blocks
from ckptio.loading.reader import file_size_problems
from ckptio.storage import FsspecStore
from ckptio.tools.inspection import every_item


def verify(store: FsspecStore, manifest: Manifest, progress: Callable[[int], None] | None = None) -> list[str]:
    """Read every stored block, check sizes and checksums; return the problems found (empty = intact)."""
    bad_files = file_size_problems(store, manifest)
    problems = [f"{store.describe(name)}: {problem}" for name, problem in bad_files.items()]
    source = byte_source(store, manifest)  # items stored in pieces (incremental saves) read run by run
    for index, item in sorted(every_item(manifest), key=lambda kv: (kv[1].file, kv[1].offset)):
        where = f"key {index.fqn!r}" + (f" chunk {tuple(index.offset)}" if index.offset is not None else "")
        where += f" (rank {index.index}'s copy)" if index.offset is None and index.index is not None else ""
        damaged = [run.file for run in manifest.extents.get(item.file, ()) if run.file in bad_files]
        if item.file in bad_files or damaged:
            problems.append(f"{where}: stored in missing or truncated file {(damaged or [item.file])[0]}")
            continue
        try:
            for _ in read_item_blocks(source, item, f"{where} in {source.describe(item.file)}"):
                pass
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
        except CheckpointError as exc:
            problems.append(f"{where}: {exc}")
        if progress:
            progress(item.stored_bytes)
    return problems
