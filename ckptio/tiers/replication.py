"""Copies of each rank's fast-tier files on partner nodes (``WriterConfig.local_tier_copies``).

After a rank's fast-tier files are written, a background job sends them, with the document that
commits them on the node (``ckptio.json`` on the coordinator, a fragment on a rank of a save without
one), to its partner ranks (``nodes.py``); each partner writes them into its own node's folder of the
same step, where they are a copy like the node's own (loads, ``ckptio.latest``, resumed drains and
pruning treat them alike). The bytes travel over a gloo group of the save's ranks made for this (one
per group of ranks, created when the first replicated save of that group writes: every rank of the
save joins it there), point to point, in pieces of ``PIECE_BYTES``, one thread per process below the
training's priority. Each piece carries its CRC32C; a received file is checked against its held index,
block by block, before it is renamed into place, so a damaged copy is never kept.

Every rank of a replicated save sends exactly one offer (possibly empty) to each partner and receives
one from each source, in save order. The copying starts once every rank of the save has committed it on
its node (a barrier of the group after each rank's commit: it runs behind the save, not beside its
writes); a rank whose save did not commit offers its files without a document (the next save, and the
process's exit, settle a commit still awaited; ``DOCUMENT_WAIT_S`` bounds the wait). A
partner that cannot store a copy (a full disk) takes the bytes and drops them, with one warning a save:
the save has succeeded, with fewer copies. A failure is logged, never raised: the durable tier still
gets every file from its drain.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import mmap
import os
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ckptio import process_exit
from ckptio.errors import StorageError
from ckptio.format.codec import checksum
from ckptio.loading.exchange import all_objects
from ckptio.storage import open_store
from ckptio.tiers.held_index import HeldIndex, index_damage
from ckptio.tiers.jobs import DrainQueue
from ckptio.tiers.nodes import NodeMap, this_node
from ckptio.tiers.paths import HELD_SUFFIX
from ckptio.torch_seam import enclosing_save_wrapper

log = logging.getLogger(__name__)

#: Bytes of a file sent as one message (one buffer per partner and per source is held at a time).
PIECE_BYTES = 8 << 20
#: How long one send or receive of the replication group may wait (a rank's document waits for its
#: save's commit; a dead peer ends a wait at once: its connection closes).
GROUP_TIMEOUT_S = 4 * 3600.0

#: How long a rank's copying waits for its save to commit on the node (all ranks' writes, then the
#: coordinator's metadata: seconds, minutes for the largest jobs); a save whose commit never comes (another
#: rank failed, so torch never called this one's finish) is copied without its document after it.
DOCUMENT_WAIT_S = 600.0

_groups: dict[tuple[int, ...], tuple[Any, NodeMap]] = {}
_sent = {"file": 0, "other": 0}
_warned: dict[str, None] = {}  # folders whose copies were refused (a warning each)
_pending_documents: list[Future] = []
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Link:
    """This rank's part in a replicated save: its group (made for replication), and the ranks there that
    receive its files and those whose files it receives."""

    group: Any
    partners: tuple[int, ...]
    sources: tuple[int, ...]


def link_of_save(members: tuple[int, ...] | None, copies: int) -> Link | None:
    """This rank's replication link for a save over the global ranks ``members`` (``None``: every rank),
    keeping ``copies`` copies of each file; ``None`` where there is nothing to copy to (one process, or
    one node). Every rank of the save calls it at the same step (it may create the group)."""
    if copies < 2 or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    members = members or tuple(range(dist.get_world_size()))
    if len(members) < 2:
        return None
    with _lock:
        if members not in _groups:
            group = dist.new_group(
                list(members),
                backend="gloo",
                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
                use_local_synchronization=True,
            )
            names = all_objects(this_node(), group)
            _groups[members] = (group, NodeMap(names))
        group, nodes = _groups[members]
    if len(nodes.nodes) < copies and dist.get_rank(group) == 0:  # once for the job, not once a rank
        _warn_few_nodes(len(nodes.nodes), copies)
    if len(nodes.nodes) < 2:
        return None
    rank = dist.get_rank(group)
    return Link(group, tuple(nodes.partners(rank, copies)), tuple(nodes.sources(rank, copies)))


def save_members(fragment_members: tuple[int, ...] | None, alone: bool) -> tuple[int, ...] | None:
    """The global ranks of the save this call runs in: a save without a coordinator knows them
    (``fragment_members``); otherwise the group of the enclosing ``dcp.save`` (``None``: every rank)."""
    if alone:
        return fragment_members
    wrapper = enclosing_save_wrapper(sys._getframe(1))
    group = getattr(wrapper, "group", None) if wrapper is not None else None
    return None if group is None else tuple(dist.get_process_group_ranks(group))


@functools.lru_cache(maxsize=4)
def _warn_few_nodes(nodes: int, copies: int) -> None:
    log.warning(
        "ckptio: local_tier_copies=%d but the save's ranks run on %d node(s): each fast-tier file is kept on %d "
        "node(s) (set CKPTIO_NODE or launch with torchrun, which sets GROUP_RANK, if the nodes are miscounted)",
        copies,
        nodes,
        min(nodes, copies),
    )


@dataclasses.dataclass
class Replicate:
    """Send this rank's fast-tier files of a save (``files``: their names in ``folder``, known once the
    rank has written them) and its node document to its partners; receive its sources' into ``folder``,
    this node's folder of the same step. Nothing before the offers may fail without a word to the partners
    (they would take the next save's offer for this one's): a file gone since is offered as absent."""

    link: Link
    url: str
    folder: str
    files: Future
    document: Future

    def run(self, deadline: float) -> None:
        try:
            self._exchange(deadline)
        except Exception as exc:  # noqa: BLE001 - the drain still uploads every file: copies are a bonus
            log.warning(
                "ckptio: the fast-tier copies of %s were not all replicated to partner nodes: %s", self.url, exc
            )

    def _exchange(self, deadline: float) -> None:
        names = self.files.result()
        try:
            document = self.document.result(timeout=max(0.0, min(DOCUMENT_WAIT_S, deadline - time.monotonic())))
        except FutureTimeout:
            document = None
        # Every rank has committed this save on its node (or given up on it): the copying runs behind the
        # save, never beside its writes.
        dist.barrier(group=self.link.group)
        name, raw = document if document else (None, b"")
        sizes = [(n, size) for n in names if (size := _size(os.path.join(self.folder, n)))]
        offers = _exchange(self.link, {"url": self.url, "files": sizes, "document": name}, raw)
        arrivals = {}
        for source, (theirs, _) in offers.items():
            if theirs.get("url") != self.url:  # a peer out of step: nothing it sends is kept
                log.warning(
                    "ckptio: rank %d of the replication group offered %r for %s", source, theirs.get("url"), self.url
                )
            arrivals[source] = _Arrivals(self.folder, theirs["files"], source, keep=theirs.get("url") == self.url)
        segments = [(file, 0, size) for file, size in sizes]
        move_files(self.link.group, self.folder, {p: segments for p in self.link.partners}, arrivals)
        for source, (theirs, (raw, whole)) in offers.items():
            if whole and arrivals[source].keep:
                _put_document(self.folder, theirs.get("document"), raw, arrivals[source])


def _size(path: str) -> int:
    """The file's size; 0 (not offered) when it is gone (an overwrite or a prune since the save)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def fixed_pieces(lengths: list[int], piece_bytes: int = PIECE_BYTES) -> list[int]:
    """The pieces a stream of ranges of ``lengths`` travels in: ``piece_bytes`` each, the last one shorter."""
    total = sum(lengths)
    return [min(piece_bytes, total - at) for at in range(0, total, piece_bytes)]


def move_files(
    group: Any,
    folder: str,
    outgoing: dict[int, list[tuple[str, int, int]]],
    incoming: dict[int, Any],
) -> None:
    """Send each group rank of ``outgoing`` its byte ranges (file, offset, length) of files in ``folder``,
    piece by piece (``fixed_pieces``), each with its CRC32C, and take each source's pieces into its arrivals
    (``incoming``: ``take``, ``expecting``). Each round posts its sends before its receives, so ranks that
    send to each other never wait on each other; a round's sends are awaited after the next round's are
    posted (the next piece is gathered while this one travels: two pieces per destination in memory at
    most)."""
    streams = {
        to: Pieces(folder, files, True, fixed_pieces([n for _, _, n in files])) for to, files in outgoing.items()
    }
    rounds = max([0, *(s.count for s in streams.values()), *(a.count for a in incoming.values())])
    in_flight: list[_Sent] = []
    for _ in range(rounds):
        sends = []
        for to, stream in streams.items():
            piece = stream.next()
            if piece is not None:
                sends.append(_isend(group, *piece, to, "file"))
        for work in in_flight:
            work.wait()
        in_flight = sends
        process_exit.progress()
        for source, arrivals in incoming.items():
            if arrivals.expecting:
                arrivals.take(*_recv(group, source))
    for work in in_flight:
        work.wait()


def _exchange(link: Link, value: dict, raw: bytes = b"") -> dict[int, tuple[dict, tuple[bytes, bool]]]:
    """Send ``value`` (JSON) and ``raw`` to every partner; what every source sent (``raw`` with whether it
    arrived whole). Sends are posted before any receive, so partners that send to each other never wait
    on each other."""
    head = json.dumps(value).encode()
    sends = [_isend(link.group, data, checksum(data), p) for p in link.partners for data in (head, raw)]
    got = {}
    for source in link.sources:
        theirs, whole = _recv(link.group, source)
        if not whole:
            raise RuntimeError(f"a message from rank {source} of the replication group fails its CRC32C")
        raw, whole_raw = _recv(link.group, source)
        got[source] = (json.loads(bytes(theirs)), (bytes(raw), whole_raw))
    for work in sends:
        work.wait()
    return got


def _isend(group: Any, data: bytes | torch.Tensor, crc: int, to: int, kind: str = "other") -> "_Sent":
    """Send ``data`` (bytes, or a uint8 tensor sent as it is) and its CRC32C to group rank ``to``: its
    length and CRC, then its bytes."""
    head = torch.tensor([len(data), crc], dtype=torch.int64)
    with _lock:
        _sent[kind] += len(data)
        _sent["other"] += head.numel() * head.element_size()
    works = [dist.isend(head, group=group, group_dst=to)]
    body = None
    if len(data):
        body = data if isinstance(data, torch.Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8)
        works.append(dist.isend(body, group=group, group_dst=to))
    return _Sent(works, head, body)


class _Sent:
    def __init__(self, works: list, *keep: Any):
        self.works, self.keep = works, keep  # the tensors stay alive until sent

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _recv(group: Any, source: int) -> tuple[memoryview, bool]:
    """A message from group rank ``source``: its bytes, and whether they match its CRC32C."""
    head = torch.zeros(2, dtype=torch.int64)
    dist.recv(head, group=group, group_src=source)
    length, crc = int(head[0]), int(head[1])
    body = torch.empty(length, dtype=torch.uint8)
    if length:
        dist.recv(body, group=group, group_src=source)
    data = memoryview(body.numpy())
    return data, checksum(data) == crc


class Pieces:
    """Byte ranges of this rank's files (``(name, offset, length)``) as one stream, sent in pieces of the
    ``sizes`` given (a piece may span ranges: many small ones travel together), each with its CRC32C. A
    piece within one run of a file's bytes is sent from the mapped file as it is (no copy); one that spans
    runs is gathered into a buffer. A range that cannot be read as it was offered is sent as zeros in a
    piece that fails its check, so the receiver stays in step and drops what that piece held."""

    def __init__(self, folder: str, segments: list[tuple[str, int, int]], checked: bool, sizes: list[int]):
        if sum(sizes) != sum(length for _, _, length in segments):
            raise ValueError(f"pieces of {sum(sizes)} bytes for ranges of {sum(length for _, _, length in segments)}")
        self.folder, self.checked, self.sizes = folder, checked, sizes
        self.runs = _runs(segments)
        self.count = len(sizes)
        self._walk = self._pieces()
        self._maps: dict[str, torch.Tensor | None] = {}  # each file mapped once

    def _pieces(self) -> Iterator[tuple[torch.Tensor, int]]:
        sizes = iter(self.sizes)
        piece, filled, unread = None, 0, False
        for name, offset, length in self.runs:
            mapped = self._mapped(name, offset + length)
            at = 0
            while at < length:
                if piece is None:
                    want = next(sizes)
                    if mapped is not None and length - at >= want:  # a whole piece in this run: sent as it is
                        view = mapped[offset + at : offset + at + want]
                        at += want
                        yield view, self._crc(view)
                        continue
                    piece, filled, unread = torch.empty(want, dtype=torch.uint8), 0, False
                n = min(length - at, len(piece) - filled)
                if mapped is None:
                    piece[filled : filled + n] = 0
                    unread = True
                else:
                    piece[filled : filled + n] = mapped[offset + at : offset + at + n]
                at, filled = at + n, filled + n
                if filled == len(piece):
                    yield piece, checksum(b"x") if unread else self._crc(piece)
                    piece = None

    def _crc(self, piece: torch.Tensor) -> int:
        return checksum(memoryview(piece.numpy())) if self.checked else 0

    def _mapped(self, name: str, end: int) -> torch.Tensor | None:
        """The file, mapped (copy on write: the tensor is writable, the file never written), or ``None``
        where it cannot be read up to ``end``."""
        if name not in self._maps:
            path = os.path.join(self.folder, name)
            try:
                with open(path, "rb") as f:
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                self._maps[name] = torch.frombuffer(mapped, dtype=torch.uint8)
            except (OSError, ValueError) as exc:  # gone, or empty
                log.warning("ckptio: cannot send the fast-tier file %s to another node: %s", path, exc)
                self._maps[name] = None
        mapped = self._maps[name]
        if mapped is not None and len(mapped) < end:
            log.warning("ckptio: the fast-tier file %s holds %d bytes, %d were offered", name, len(mapped), end)
            return None
        return mapped

    def next(self) -> tuple[torch.Tensor, int] | None:
        return next(self._walk, None)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        return self._walk


def _runs(segments: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """``segments`` with each range that continues the one before it in the same file joined to it."""
    runs: list[tuple[str, int, int]] = []
    for name, offset, length in segments:
        if runs and runs[-1][0] == name and runs[-1][1] + runs[-1][2] == offset:
            runs[-1] = (name, runs[-1][1], runs[-1][2] + length)
        elif length:
            runs.append((name, offset, length))
    return runs


class _Arrivals:
    """A source's files arriving piece by piece: each written beside its final name, checked against its
    held index once whole and renamed into place; a file that cannot be stored, or fails a check, is taken
    and dropped."""

    def __init__(self, folder: str, files: list, source: int, keep: bool):
        self.folder, self.source, self.keep = folder, source, keep
        self.files = [(str(name), int(size)) for name, size in files if int(size) > 0]
        self.count = len(fixed_pieces([size for _, size in self.files]))
        self.done: list[str] = []
        self._at, self._written, self._handle, self._dropping = 0, 0, None, False

    @property
    def expecting(self) -> bool:
        return self._at < len(self.files)

    def take(self, data: memoryview, whole: bool) -> None:
        """A piece of the stream: the parts of the files it holds (``whole``: it passed its CRC32C)."""
        at = 0
        while at < len(data) and self.expecting:
            name, size = self.files[self._at]
            n = min(size - self._written, len(data) - at)
            self._take_part(name, size, data[at : at + n], whole)
            at += n

    def _take_part(self, name: str, size: int, data: memoryview, whole: bool) -> None:
        if self._written == 0:
            self._dropping = not (self.keep and _safe_name(name))
            self._handle = None if self._dropping else self._open(name)
        if not whole and not self._dropping:
            self._drop(name, f"a piece from rank {self.source} failed its CRC32C on arrival", warn=False)
            log.warning(
                "ckptio: a partner copy of %s from rank %d failed its check on arrival; not kept", name, self.source
            )
        if self._handle is not None:
            try:
                self._handle.write(data)
            except OSError as exc:
                self._drop(name, str(exc))
        self._written += len(data)
        if self._written >= size:
            if self._handle is not None:
                self._finish(name)
            self._at, self._written, self._handle = self._at + 1, 0, None

    def _open(self, name: str) -> Any:
        try:
            os.makedirs(os.path.dirname(self._partial(name)), exist_ok=True)
            return open(self._partial(name), "wb")
        except OSError as exc:
            self._drop(name, str(exc))
            return None

    def _drop(self, name: str, why: str, warn: bool = True) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        _remove(self._partial(name))
        self._dropping = True
        if warn:
            _warn_not_kept(self.folder, why)

    def _finish(self, name: str) -> None:
        handle, self._handle = self._handle, None
        try:
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
            if name.endswith(HELD_SUFFIX) and name[: -len(HELD_SUFFIX)] not in self.done:
                _remove(self._partial(name))  # its data file was dropped (and said so): the index goes too
                return
            if name.endswith(HELD_SUFFIX):
                problem = self._check(name)
                if problem:
                    log.warning("ckptio: a partner copy from rank %d is damaged (%s); not kept", self.source, problem)
                    data = name[: -len(HELD_SUFFIX)]
                    _remove(self._partial(name), os.path.join(self.folder, data))
                    self.done = [done for done in self.done if done != data]
                    return
            os.replace(self._partial(name), os.path.join(self.folder, name))
            self.done.append(name)
        except OSError as exc:
            _remove(self._partial(name))
            _warn_not_kept(self.folder, str(exc))

    def _check(self, held: str) -> str | None:
        """The data file this index describes (received before it) against the index."""
        try:
            with open(self._partial(held), "rb") as f:
                index = HeldIndex.decode(f.read())
        except (ValueError, KeyError, TypeError, OSError) as exc:
            return f"its index cannot be read: {exc}"
        if index.file + HELD_SUFFIX != held or index.file not in self.done:
            return f"its index {held} does not describe a file received with it"
        try:
            return index_damage(os.path.join(self.folder, index.file), index)
        except ValueError as exc:
            return f"its index is malformed: {exc}"

    def _partial(self, name: str) -> str:
        return os.path.join(self.folder, f"{name}.partial-{os.getpid()}")


def _put_document(folder: str, name: str | None, raw: bytes | None, arrivals: _Arrivals) -> None:
    """The source's node document, kept only with every file it sent (a document without its files
    would make the node count a copy it does not hold)."""
    if not name or raw is None or not _safe_name(name) or len(arrivals.done) != len(arrivals.files):
        return
    store = open_store(folder)
    try:
        store.prepare_directory()
        store.put_atomic(name, raw)
    except (OSError, StorageError) as exc:
        _warn_not_kept(folder, str(exc))


def _safe_name(name: Any) -> bool:
    """A name inside the step's folder (a peer's offer is input like any file)."""
    parts = name.split("/") if isinstance(name, str) else [""]
    return all(part not in ("", ".", "..") for part in parts) and not name.startswith("/")


def _remove(*paths: str) -> None:
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass


def _warn_not_kept(folder: str, why: str) -> None:
    """One warning per save (per folder) on a node that cannot keep partners' copies."""
    with _lock:
        if folder in _warned:
            return
        _warned[folder] = None
        while len(_warned) > 64:
            _warned.pop(next(iter(_warned)))
    log.warning(
        "ckptio: this node cannot keep a partner's fast-tier copy in %s (%s); the save stands, with fewer copies",
        folder,
        why,
    )


def bytes_sent() -> dict[str, int]:
    """Bytes this process has sent to other nodes (copies, and fetches for loads): ``"file"``, of files;
    ``"other"``, of offers, documents and message heads."""
    with _lock:
        return dict(_sent)


def document_future() -> Future:
    """A rank's node document of a save, resolved when it commits on the node (``None``: it did not)."""
    future: Future = Future()
    with _lock:
        _pending_documents[:] = [f for f in _pending_documents if not f.done()]
        _pending_documents.append(future)
    return future


def settle_documents() -> None:
    """Documents still pending are of saves that did not commit (a later save began, or the process is
    waiting for its uploads or exiting): partners are told there is none."""
    with _lock:
        pending, _pending_documents[:] = list(_pending_documents), []
    for future in pending:
        if not future.done():
            future.set_result(None)


def resolved(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


_QUEUE = DrainQueue("ckptio-copies", "copies to partner nodes")


def replication_queue() -> DrainQueue:
    """This process's copying to partner nodes: one thread, jobs in save order."""
    return _QUEUE


def wait_for_copies(timeout: float | None = None) -> None:
    """Block until this process's copies to partner nodes are done (they never raise: see the module)."""
    _QUEUE.wait(timeout)


process_exit.background_work("copies to partner nodes", lambda: _QUEUE.pending, settle_documents)
