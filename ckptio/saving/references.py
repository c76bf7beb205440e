"""Which data files of a checkpoint other checkpoints reference, so that deleting or replacing it keeps them.

An incremental save (``WriterConfig.incremental_from``) stores references to stored bytes of sibling
checkpoints in the same folder (always to the folder whose save wrote them). Before it commits, it leaves
in each such sibling a marker, ``ckptio.referenced-by-<its folder name>.json``, listing the files it
needs there, and then checks they are all still present (a deletion that began first either sees the
marker or has removed a file, and the save fails instead of committing a broken checkpoint).

A marker is *live* while its referrer is committed (its ``ckptio.json`` exists) or may still be saving
(its folder has no ``ckptio.json`` yet): deletes and overwrites keep the files live markers list. What
decides a deletion is listed strictly: a listing that fails raises, it is never taken for an empty folder.
``ckptio gc`` (which must not run beside a save) treats the markers of uncommitted referrers as stale.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ckptio.errors import CheckpointError, CorruptCheckpointError
from ckptio.format.names import (
    METADATA_NAME,
    is_data_file_name,
    parse_reference_marker_name,
    reference_marker_name,
    sibling_file_name,
    split_sibling_file_name,
)
from ckptio.loading.fragment_set import fragments_in
from ckptio.storage import FsspecStore


def folder_name(store: FsspecStore) -> str:
    return store.url.rstrip("/").rpartition("/")[2]


def by_sibling(files: Any) -> dict[str, list[str]]:
    """Sibling folder -> the names there of the sibling data files among ``files`` (names as a checkpoint
    stores them: ``../<sibling>/<name>``)."""
    found: dict[str, list[str]] = {}
    for name in files:
        sibling, own = split_sibling_file_name(name)
        if sibling is not None:
            found.setdefault(sibling, []).append(own)
    return found


def mark_references(
    store: FsspecStore,
    files: dict[str, int],
    save_id: str | None,
    rank: int | None = None,
    pending_s: float = 0.0,
    checked_later: bool = False,
) -> None:
    """Before an incremental save at ``store`` commits: a marker in every sibling it references (``rank``'s
    own, for a rank's fragment of a save without a coordinator), then every referenced file checked
    present at its recorded size (else the save fails, naming it), unless ``checked_later`` (a tiered save's
    commit, whose base may still be draining now). ``pending_s``: how long the commit may still take (a
    tiered save's drain): the marker keeps the files that long even while the referrer's folder is empty."""
    referrer = folder_name(store)
    for sibling, names in sorted(by_sibling(files).items()):
        base = store.sibling(sibling)
        marker = {"referrer": referrer, "save_id": save_id, "files": sorted(names)}
        if pending_s:
            marker["pending_until"] = round(time.time() + pending_s, 3)
        if checked_later:  # the base may still be on its way: its folder may not be there yet
            base.prepare_directory()
        base.put_atomic(reference_marker_name(referrer, rank), json.dumps(marker).encode())
    if not checked_later:
        check_references(store, files)


def missing_references(store: FsspecStore, files: dict[str, int]) -> list[tuple[str, bool]]:
    """The sibling files among ``files`` (as the checkpoint at ``store`` names them) that are not at their
    recorded size in their folders: each described, and whether it is gone (else its size changed)."""
    missing = []
    for sibling, names in sorted(by_sibling(files).items()):
        base = store.sibling(sibling)
        present = base.list_sizes() or {}
        for name in names:
            if present.get(name) != files[sibling_file_name(sibling, name)]:
                missing.append((base.describe(name), name not in present))
    return missing


def check_references(store: FsspecStore, files: dict[str, int]) -> None:
    """Every sibling file among ``files`` is present at its recorded size, else the save fails naming it."""
    for where, gone in missing_references(store, files)[:1]:
        raise CheckpointError(
            f"{where}, which this incremental save references, {'is gone' if gone else 'changed size'} (deleted "
            "while the save ran?); the save was not committed. Save again (in full, or against a checkpoint that "
            "is still there)"
        )


def files_in_use(
    store: FsspecStore, names: list[str] | None = None, saving_counts: bool = True
) -> tuple[set[str], list[str]]:
    """The data files at ``store`` that other checkpoints reference (by their live markers), and the
    names of the markers that are stale. ``saving_counts``: a referrer without a commit may be saving
    (deletes keep its files); ``gc`` passes False."""
    names = store.list_names(strict=True) if names is None else names  # a failed listing is no empty folder
    used: set[str] = set()
    stale: list[str] = []
    for name in names or []:
        referrer = parse_reference_marker_name(name)
        if referrer is None:
            continue
        listed, pending_until = _marker_files(store, name)
        live = listed is not None and (time.time() < pending_until or _referrer_live(store, referrer, saving_counts))
        if live:
            used.update(listed)
        else:
            stale.append(name)
    return used, stale


def release(store: FsspecStore, bases: list[str], rank: int | None | str = "every") -> None:
    """After the checkpoint at ``store`` is deleted (its markers of ``"every"`` rank), or replaced (the
    coordinator's marker, ``None``; a rank's, when its fragment was): those markers in the siblings it
    referenced go, and a sibling that was deleted but kept for it (no ``ckptio.json``, no live marker
    left) goes whole."""
    referrer = folder_name(store)
    for sibling in bases:
        base = store.sibling(sibling)
        names = base.list_names(strict=True) or []
        if rank == "every":
            markers = [name for name in names if parse_reference_marker_name(name) == referrer]
        else:
            markers = [name for name in [reference_marker_name(referrer, rank)] if name in names]  # type: ignore[arg-type]
        for name in markers:
            base.remove(name)
        names = [name for name in names if name not in markers]
        if _committed(names):
            continue
        used, _ = files_in_use(base, names)
        if not used:
            base.remove_all()


def _marker_files(store: FsspecStore, name: str) -> tuple[list[str] | None, float]:
    """The files a marker lists, and until when its referrer may still commit (unix time; 0: not pending)."""
    try:
        marker = json.loads(store.read(name))
    except FileNotFoundError:
        return None, 0.0
    except ValueError:
        raise CorruptCheckpointError(
            f"{store.describe(name)} is not a reference marker (JSON); it protects data files another checkpoint "
            "uses. Restore it, or delete the checkpoints of this folder with ckptio"
        ) from None
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) and is_data_file_name(f) for f in files):
        raise CorruptCheckpointError(f"{store.describe(name)} does not list data files; restore it")
    pending_until = marker.get("pending_until", 0.0)
    return files, float(pending_until) if type(pending_until) in (int, float) else 0.0


def _referrer_live(store: FsspecStore, referrer: str, saving_counts: bool) -> bool:
    other = store.sibling(referrer)
    if other.exists(METADATA_NAME):  # a request, where listing a folder of thousands of files is many
        return True
    names = other.list_names(strict=True) or []
    return _committed(names) or (saving_counts and bool(names))


def _committed(names: list[str]) -> bool:
    """Whether a folder listing ``names`` (a strict listing) holds a checkpoint: its ``ckptio.json``, or
    fragments of a save without a coordinator (any: a set that may still be completing counts too)."""
    return METADATA_NAME in names or bool(fragments_in(names))
