"""The commit policy: a checkpoint becomes loadable when its ``ckptio.json`` is published (or, saved
without a coordinator, when every rank's fragment is), and a committed checkpoint is replaced only
when the save asked to overwrite it, in which case the old data files are deleted only after the new
metadata has replaced the old."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ckptio.errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    MixedFragmentsError,
    StorageError,
)
from ckptio.format.document import decode_fragment, decode_metadata
from ckptio.format.fragments import check_set
from ckptio.format.names import METADATA_NAME, own_file_names, parse_fragment_name
from ckptio.loading.fragment_set import complete_set, fragments_in, merged_metadata
from ckptio.saving.references import by_sibling, files_in_use, release
from ckptio.storage import FsspecStore

log = logging.getLogger(__name__)


def check_target(store: FsspecStore, overwrite: bool) -> list[str]:
    """Refuse to replace a committed checkpoint unless ``overwrite``; return the data files an
    overwrite supersedes (to delete once the new checkpoint has committed). Fragments of a save
    without a coordinator are not looked for (it would cost every save a listing): a ``ckptio.json``
    committed beside them is what loads read, and they are left for ``gc``."""
    files = _committed_files(store, METADATA_NAME, decode_metadata)
    if files is not None and not overwrite:
        raise exists_error(store.describe(METADATA_NAME))
    store.check_conditional_writes()
    return files or []


def _committed_files(store: FsspecStore, name: str, decode: Callable[[bytes, str], Any]) -> list[str] | None:
    """The data files the metadata document ``name`` at ``store`` names (``decode`` reads it); ``None``
    when there is none, ``[]`` (and a warning) when it does not decode: an overwrite leaves those in place."""
    try:
        old = store.read(name)
    except FileNotFoundError:
        return None
    except CheckpointNotFoundError as exc:  # e.g. no such bucket: nowhere to save to
        raise StorageError(f"cannot save to {store.url}: {exc}") from None
    try:
        return sorted(decode(old, store.describe(name)).files)  # a sibling's too (``publish`` keeps those)
    except CheckpointFormatError as exc:
        log.warning("ckptio: overwriting an unreadable %s; its data files are left in place: %s", name, exc)
        return []


def exists_error(what: str) -> CheckpointExistsError:
    """The refusal of a save over the committed checkpoint ``what`` (every rank that refuses says the same)."""
    return CheckpointExistsError(
        f"{what} already holds a committed checkpoint; save to a new path, or pass overwrite=True "
        "(ckptio.Writer(path, overwrite=True) or WriterConfig(overwrite=True)) to replace it (the old one stays "
        "loadable until the new one commits)"
    )


def clear_for_fragments(store: FsspecStore, overwrite: bool) -> None:
    """Before a save without a coordinator (on its rank 0 alone): a committed ``ckptio.json`` there
    would hide the fragments from every load, so it is refused, or with ``overwrite`` deleted. Where it
    is the merge of the fragments there (an earlier save without a coordinator, merged by its rank 0 or
    ``ckptio merge``), its data files are theirs and stay: the set still loads until each rank's new
    fragment replaces its own and deletes its files (``publish_fragment``); else they go with it."""
    files = _committed_files(store, METADATA_NAME, decode_metadata)
    if files is not None and not overwrite:
        raise exists_error(store.describe(METADATA_NAME))
    store.check_conditional_writes()
    if files is None:
        return
    merged = _merged_from_fragments(store)
    store.remove(METADATA_NAME)
    if not merged:
        _drop_replaced(store, files, {})


def _merged_from_fragments(store: FsspecStore) -> bool:
    """Whether ``ckptio.json`` at ``store`` is the merge of the fragment set there (same save)."""
    found = sorted(fragments_in(store.list_names() or []))
    if not found:
        return False
    try:
        merged = decode_metadata(store.read(METADATA_NAME), store.describe(METADATA_NAME)).header.save_id
        return _fragment_info(store, found[0]).save_id == merged
    except (CheckpointFormatError, FileNotFoundError):
        return False


def _fragment_info(store: FsspecStore, name: str) -> Any:
    return decode_fragment(store.read(name), store.describe(name))[1]


def publish_fragment(store: FsspecStore, name: str, document: bytes, files: dict[str, int], overwrite: bool) -> None:
    """Commit one rank's fragment as ``publish`` commits ``ckptio.json``: created only if absent, or
    with ``overwrite`` replacing the one an earlier save left (whose data files are then deleted). Without
    ``overwrite``, a fragment there is replaced all the same when its set never formed a checkpoint
    (``stale_fragment``): every rank of a requeued job that saves a step an earlier attempt left incomplete
    takes the same way, where each rank's own fragment used to decide alone."""
    superseded = _committed_files(store, name, _fragment_manifest) if overwrite else None
    rank = parse_fragment_name(name).rank  # type: ignore[union-attr]
    save_id = decode_fragment(document, store.describe(name))[1].save_id
    stale = lambda: stale_fragment(store, name, save_id)  # noqa: E731
    publish(store, document, files, superseded or [], overwrite, name, rank, stale)


def stale_fragment(store: FsspecStore, name: str, save_id: str) -> list[str] | None:
    """The data files of the fragment ``name`` at ``store`` when it is no part of a committed checkpoint (an
    incomplete set, one mixing saves, a damaged fragment, or one of save ``save_id`` itself, published by an
    attempt whose answer was lost), so that a new fragment of ``save_id`` may replace it; ``None`` when the
    set there is committed: a ``ckptio.json``, or every rank's fragment of one save. Every rank that asks
    sees the same set, so all of a save's ranks replace theirs, or all are refused."""
    try:
        if _fragment_info(store, name).save_id == save_id:
            return _committed_files(store, name, _fragment_manifest) or []
        if store.exists(METADATA_NAME):
            return None
        found = fragments_in(store.list_names() or [])
        check_set(found, store.url)
        if len({_fragment_info(store, other).save_id for other in found}) == 1:  # read only for a whole set
            return None
    except (IncompleteCheckpointError, MixedFragmentsError, CheckpointFormatError, FileNotFoundError):
        pass
    return _committed_files(store, name, _fragment_manifest) or []


def _fragment_manifest(raw: bytes, where: str) -> Any:
    return decode_fragment(raw, where)[0]


def publish(
    store: FsspecStore,
    document: bytes,
    files: dict[str, int],
    superseded: list[str],
    overwrite: bool,
    name: str = METADATA_NAME,
    rank: int | None = None,
    replaceable: Callable[[], list[str] | None] | None = None,
) -> None:
    """Commit: publish the metadata (``name``: ``ckptio.json``, or ``rank``'s fragment), then delete the
    superseded data files it no longer names. ``replaceable``: where the document is there already, the data
    files of the one there if it may be replaced all the same, else ``None``.

    Without ``overwrite`` the metadata is created only if absent, atomically where the backend
    allows it (POSIX: a hard link; S3: a conditional PUT), so of two jobs saving to one path at
    once exactly one commits; the other's data files are deleted and it raises."""
    store.prepare_directory()  # no rank may have written a data file (everything inline)
    if overwrite:
        store.put_atomic(name, document)
    else:
        try:
            store.put_if_absent(name, document)
        except FileExistsError:
            stale = replaceable() if replaceable is not None else None
            if stale is None:
                store.delete_best_effort(sorted(own_file_names(files)))  # never a sibling's, which it referenced
                raise _taken(store.describe(name), name == METADATA_NAME) from None
            store.put_atomic(name, document)
            superseded = stale
    _drop_replaced(store, superseded, files, "every" if rank is None else rank)


def _drop_replaced(
    store: FsspecStore, superseded: list[str], files: dict[str, int], markers: int | None | str = None
) -> None:
    """After a checkpoint's metadata was replaced by a document naming ``files``: delete the data files
    of the old one (``superseded``) the new one does not name and no incremental checkpoint references,
    and release the siblings only the old one referenced, of their markers by this checkpoint those
    ``references.release`` takes: ``"every"`` (a ``ckptio.json`` replaced by another), the coordinator's
    (``None``: before a save without one, whose ranks may have left theirs already), or a rank's (its
    fragment replaced)."""
    stale = own_file_names(file for file in superseded if file not in files)
    if stale:
        store.delete_best_effort(_unreferenced(store, stale))
    dropped = by_sibling(superseded).keys() - by_sibling(files).keys()
    if dropped:  # the replaced checkpoint referenced siblings this one does not: they need not keep those files
        try:
            release(store, sorted(dropped), markers)
        except StorageError as exc:  # committed already: what is left is kept, never wrongly deleted
            log.warning("ckptio: cannot release %s of the checkpoint it replaced; gc removes it: %s", dropped, exc)


def _unreferenced(store: FsspecStore, files: list[str]) -> list[str]:
    """Of the data files a replaced checkpoint leaves, those no incremental checkpoint references (none,
    when the markers cannot be listed: ``gc`` removes them later)."""
    try:
        used, _ = files_in_use(store)
    except StorageError as exc:
        log.warning("ckptio: cannot list %s for the files references keep; replaced files left: %s", store.url, exc)
        return []
    return [file for file in files if file not in used]


def _taken(what: str, coordinated: bool) -> CheckpointExistsError:
    if coordinated:
        return CheckpointExistsError(
            f"another save committed {what} while this one was writing; this save's data files were removed and "
            "the other checkpoint is intact. Save each job to its own path"
        )
    return exists_error(f"{what} (this rank's fragment of an earlier save without a coordinator)")


def commit_merged(
    store: FsspecStore, save_id: str | None = None, go_on: Callable[[], bool] = lambda: True
) -> dict[str, int] | None:
    """``ckptio merge``, and rank 0 after its save without a coordinator (``merge_once``): write the merge
    of a complete fragment set at ``store`` as its ``ckptio.json`` (created only if absent), so that loads
    read one document instead of merging; the fragments stay (a later save there finds their names taken,
    as it finds a committed checkpoint). Returns the data files of the merged checkpoint, or ``None``
    when ``ckptio.json`` is already there, the set is not of save ``save_id`` (when given), or ``go_on``
    says no once the set is merged."""
    if store.exists(METADATA_NAME):
        return None
    fragments = complete_set(store)
    if not fragments:
        raise CheckpointNotFoundError(f"{store.url} holds no fragments of a save without a coordinator to merge")
    document = merged_metadata(store, fragments)
    header = decode_metadata(document, f"{store.url}: the merge of its {len(fragments)} fragments").header
    if (save_id is not None and header.save_id != save_id) or not go_on():
        return None
    files = header.files
    try:
        store.put_if_absent(METADATA_NAME, document)
    except FileExistsError:
        return None
    return files
