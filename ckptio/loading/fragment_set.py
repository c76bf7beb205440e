"""The fragments of a save without a coordinator at a checkpoint location: found by one listing, read
concurrently, merged into the metadata document every reader decodes (``versions.merge_fragments``).

A location's ``ckptio.json``, when there is one, is what loads read: a save with a coordinator, or the
fragments merged by ``ckptio merge``. Without it, a complete set of fragments of one save is the
checkpoint; an incomplete or mixed set is refused by name.
"""

from __future__ import annotations

import concurrent.futures

from ckptio.config import FRAGMENT_READS
from ckptio.errors import CheckpointError
from ckptio.format.document import merge_fragments
from ckptio.format.fragments import check_set
from ckptio.format.names import FragmentName, parse_fragment_name
from ckptio.gc_pause import paused_gc
from ckptio.storage import FsspecStore


class FragmentsFound(CheckpointError):
    """There is no ``ckptio.json`` but there are fragments: the ranks of a load that share their
    metadata read hand this to each other, then merge on one rank (``Reader``)."""


def fragments_in(names: list[str]) -> dict[str, FragmentName]:
    """The fragment names among a location's names."""
    return {name: parsed for name in names if (parsed := parse_fragment_name(name)) is not None}


def complete_set(store: FsspecStore, names: list[str] | None = None) -> dict[str, FragmentName]:
    """The fragments at ``store`` (``names``: its listing, if made), empty if there are none; raises
    ``IncompleteCheckpointError`` (naming the missing ranks) or ``MixedFragmentsError`` unless they
    form one complete set by name."""
    found = fragments_in(store.list_names() or [] if names is None else names)
    if found:
        check_set(found, store.url)
    return found


@paused_gc()
def merged_metadata(store: FsspecStore, fragments: dict[str, FragmentName]) -> bytes:
    """The metadata document of the complete set ``fragments`` (``complete_set``) at ``store``."""
    ranks = next(iter(fragments.values())).ranks
    read = _read_fragment(store)
    if not store.remote:  # a local disk answers from its page cache: threads would only add ~50 us a read
        return merge_fragments(zip(fragments, map(read, fragments), strict=True), ranks, store.url)
    workers = max(1, min(FRAGMENT_READS, len(fragments)))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ckptio-fragments") as pool:
        return merge_fragments(zip(fragments, pool.map(read, fragments), strict=True), ranks, store.url)


def _read_fragment(store: FsspecStore):
    def read(name: str) -> bytes:
        try:
            return store.read(name)
        except FileNotFoundError:
            raise CheckpointError(
                f"{store.describe(name)} was listed but is gone: a save or delete at this path is running. "
                "Load again once it has finished"
            ) from None

    return read
