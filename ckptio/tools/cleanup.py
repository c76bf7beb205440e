"""What unfinished saves left beside a checkpoint (``ckptio gc``), and removing a checkpoint whole
(its commit marker first)."""

from __future__ import annotations

import dataclasses

from ckptio.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError, MixedFragmentsError
from ckptio.format.document import decode_fragment, decode_metadata
from ckptio.format.names import (
    METADATA_NAME,
    REBASE_NAME,
    REFUSED_SUFFIX,
    TORCH_DCP_METADATA_NAME,
    is_data_file_name,
    parse_reference_marker_name,
)
from ckptio.format.records import Manifest
from ckptio.loading.fragment_set import complete_set, fragments_in
from ckptio.loading.reader import read_manifest
from ckptio.saving.merge_once import settle
from ckptio.saving.references import by_sibling, files_in_use, release
from ckptio.storage import FsspecStore


def orphaned_files(
    store: FsspecStore, manifest: Manifest | None, names: list[str] | None = None, in_use: set[str] | None = None
) -> list[str]:
    """Data files beside the checkpoint that it does not use (left by saves that never committed), nor
    a committed incremental checkpoint references (``in_use``, if already found); every other data file
    where nothing has committed (``manifest`` None)."""
    names = store.list_names(nested=True) if names is None else names
    if in_use is None:
        in_use = files_in_use(store, names or [], saving_counts=False)[0]
    used = in_use | (set(manifest.files) if manifest is not None else set())
    return [n for n in names or [] if is_data_file_name(n) and n not in used]


@dataclasses.dataclass
class Garbage:
    """What saves that never committed left at a checkpoint location."""

    files: list[str]
    uploads: list[tuple[str, str]]  # (object name, upload id) of unfinished multipart uploads


def find_garbage(store: FsspecStore) -> Garbage:
    """Orphaned data files and unfinished uploads at ``store``'s location. If a save to this
    location is running right now, its files and uploads are listed too."""
    try:
        manifest: Manifest | None = read_manifest(store)
    except (CheckpointNotFoundError, IncompleteCheckpointError, MixedFragmentsError):
        manifest = None
    uploads = [(name, upload_id) for name, upload_id in store.open_uploads() if is_data_file_name(name)]
    names = store.list_names(nested=True) or []
    in_use, stale_markers = files_in_use(store, names, saving_counts=False)
    orphans = orphaned_files(store, manifest, names, in_use)
    # of drains that gave up, and rebases whose commit did not come
    refusals = [name for name in names if name.endswith(REFUSED_SUFFIX) or name == REBASE_NAME]
    return Garbage(stale_fragments(store, manifest) + stale_markers + orphans + refusals, uploads)


def stale_fragments(store: FsspecStore, manifest: Manifest | None) -> list[str]:
    """Fragments of saves without a coordinator that are not the checkpoint: of a save that never
    completed (or of two saves), or beside a ``ckptio.json`` of another save (not their ``ckptio merge``:
    its save id is theirs)."""
    fragments = sorted(fragments_in(store.list_names() or []))
    if not fragments or manifest is None:
        return fragments
    if not store.exists(METADATA_NAME):  # the checkpoint is these fragments, merged
        return []
    try:
        _, info = decode_fragment(store.read(fragments[0]), store.describe(fragments[0]))
    except (FileNotFoundError, CheckpointError):
        return fragments
    return [] if info.save_id == manifest.header.save_id else fragments


def collect_garbage(store: FsspecStore, garbage: Garbage) -> dict[str, str]:
    """Abort the uploads and delete the files of ``garbage``; return what could not be removed
    (``{description: cause}``, empty when everything went): a refused delete is reported, not logged."""
    failed: dict[str, str] = {}
    for name, upload_id in garbage.uploads:
        try:
            store.abort_upload(name, upload_id)
        except CheckpointError as exc:
            failed[f"upload {upload_id} of {store.describe(name)}"] = str(exc)
    for name in garbage.files:
        try:
            store.remove(name)
        except CheckpointError as exc:
            failed[store.describe(name)] = str(exc)
    return failed


#: The file whose presence makes a folder a loadable checkpoint -> the format it is in.
COMMIT_MARKERS = {METADATA_NAME: "ckptio", TORCH_DCP_METADATA_NAME: "torch_dcp", "model.safetensors.index.json": "hf"}


def checkpoint_format(store: FsspecStore) -> str | None:
    """``"ckptio"``, ``"torch_dcp"`` or ``"hf"`` for a committed checkpoint at ``store`` (for ckptio,
    also a complete set of fragments of a save without a coordinator); ``None`` if nothing there is
    loadable (absent, or a save that never committed)."""
    found = next((name for marker, name in COMMIT_MARKERS.items() if store.exists(marker)), None)
    if found is None:
        try:
            return "ckptio" if complete_set(store) else None
        except CheckpointError:  # incomplete or mixed: not loadable
            return None
    return found


def delete_checkpoint(store: FsspecStore) -> list[str]:
    """Remove the checkpoint at ``store``. Its commit marker goes first (a fragment set's commit is every
    fragment: rank 0's goes first), so a deletion cut short leaves an uncommitted folder (never loadable,
    cleaned by ``gc``), not a committed one with files missing; then every object under it and any
    unfinished multipart upload, except the data files incremental checkpoints beside it reference (and
    their markers): those stay until the last of them is deleted, and are returned. The siblings this
    checkpoint referenced are released (``references.release``)."""
    settle(store.url)  # this process's merge of a save without a coordinator there is called off
    bases = _referenced_siblings(store)
    for marker in COMMIT_MARKERS:
        store.remove(marker)
    for name in sorted(fragments_in(store.list_names() or [])):
        store.remove(name)
    for name, upload_id in store.open_uploads():
        store.abort_upload(name, upload_id)
    names = store.list_names(nested=True, strict=True) or []  # a failed listing must not read as "no markers"
    used, stale = files_in_use(store, names)
    if used:
        kept = used | {name for name in names if parse_reference_marker_name(name)} - set(stale)
        for name in names:
            if name not in kept:
                store.remove(name)
    else:
        store.remove_all()
    release(store, bases)
    return sorted(used)


def _referenced_siblings(store: FsspecStore) -> list[str]:
    """The sibling checkpoints whose data the checkpoint at ``store`` references: by its ``ckptio.json``,
    else by each rank's fragment (a save without a coordinator that was never merged); none of what
    cannot be read."""
    siblings: set[str] = set()
    try:
        return sorted(by_sibling(decode_metadata(store.read(METADATA_NAME), store.describe(METADATA_NAME)).files))
    except (FileNotFoundError, CheckpointError):
        pass
    for name in sorted(fragments_in(store.list_names() or [])):
        try:
            siblings.update(by_sibling(decode_fragment(store.read(name), store.describe(name))[0].files))
        except (FileNotFoundError, CheckpointError):
            continue
    return sorted(siblings)
