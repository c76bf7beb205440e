"""Items several ranks hold under one key: torch keeps one rank's value and drops the rest, so
ckptio compares what every rank holds under each key and fails the save when they differ
(or, for objects with ``differing_objects="keep_per_rank"``, keeps every rank's value).

Compared: every object (by value: a canonical encoding of plain containers, numbers, strings,
bytes and tensors, so a ``set`` that pickles in per-process hash order still compares equal;
other types by their pickle), and every plain tensor saved whole (all bytes up to
``FULL_DIGEST_BYTES``, beyond that ``SAMPLED_ELEMENTS`` evenly spaced elements plus dtype and
shape: a bounded check that catches per-rank RNG states and counters, not a single flipped
element in a huge tensor). Sharded DTensors are not compared.

Each rank's findings travel to the coordinator as an ``ObjectReport`` riding along with its
write results; ``attach_report`` and ``split_reports`` are the only code that knows how.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ckptio.config import FULL_DIGEST_BYTES, SAMPLED_ELEMENTS
from ckptio.errors import PerRankStateError
from ckptio.format.codec import checksum
from ckptio.format.records import MeshRecord, StoredItem

#: Index name of the per-rank report riding along with a rank's write results.
_REPORT_KEY = "__ckptio_object_report__"


Digest = tuple  # ("object" | "tensor", ...): equal digests <=> (almost surely) equal values


def value_digests(
    held: dict[MetadataIndex, WriteItem], planner: SavePlanner, pickled: dict[MetadataIndex, memoryview]
) -> dict[str, Digest]:
    """The digest of every object and every whole plain tensor this rank holds, by key
    (``held`` maps each stored key to the item as the planner names it)."""
    digests: dict[str, Digest] = {}
    state = getattr(planner, "state_dict", None) or {}
    for index, item in held.items():
        if item.type == WriteItemType.BYTE_IO:
            digests[index.fqn] = _object_digest(planner, item, pickled[index])
        elif type(state.get(item.index.fqn)) is torch.Tensor and _whole(item):  # noqa: E721 - not a DTensor
            digests[index.fqn] = _tensor_digest(state[item.index.fqn])
    return digests


def _whole(item: WriteItem) -> bool:
    chunk = item.tensor_data.chunk
    return not any(chunk.offsets) and tuple(chunk.sizes) == tuple(item.tensor_data.size)


def _object_digest(planner: SavePlanner, item: WriteItem, pickled: memoryview) -> Digest:
    lookup = getattr(planner, "lookup_object", None)
    if lookup is not None:
        try:
            encoded = _Canonical().encode(lookup(item.index))
            return ("object", checksum(encoded), len(encoded))
        except _NotCanonical:
            pass
    return ("object-pickle", checksum(pickled), len(pickled))


def _tensor_digest(tensor: torch.Tensor) -> Digest:
    t = tensor.detach().resolve_conj().resolve_neg()
    nbytes = t.numel() * t.element_size()
    if nbytes > FULL_DIGEST_BYTES:
        flat = t.reshape(-1)
        positions = torch.arange(SAMPLED_ELEMENTS, dtype=torch.int64, device=flat.device)
        t = flat[positions * (flat.numel() - 1) // (SAMPLED_ELEMENTS - 1)]
    data = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return ("tensor", str(tensor.dtype), tuple(tensor.shape), checksum(memoryview(data).cast("B")))


class _NotCanonical(Exception):
    pass


class _Canonical:
    """A byte encoding of plain values that is equal exactly when the values are equal
    (sets and dict keys sorted by their encoding, so iteration order does not matter)."""

    MAX_NODES = 100_000  # beyond this, compare pickles: the check must stay cheap

    def __init__(self) -> None:
        self.nodes = 0

    def encode(self, value: Any) -> bytes:
        self.nodes += 1
        if self.nodes > self.MAX_NODES:
            raise _NotCanonical
        if value is None or isinstance(value, (bool, int, str, bytes)):
            return repr((type(value).__name__, value)).encode()
        if isinstance(value, float):
            return b"float:" + (b"nan" if math.isnan(value) else value.hex().encode())
        if isinstance(value, (list, tuple)):
            return type(value).__name__.encode() + b"[" + b",".join(map(self.encode, value)) + b"]"
        if isinstance(value, (set, frozenset)):
            return type(value).__name__.encode() + b"{" + b",".join(sorted(map(self.encode, value))) + b"}"
        if isinstance(value, dict):
            pairs = sorted(self.encode(k) + b":" + self.encode(v) for k, v in value.items())
            return b"dict{" + b",".join(pairs) + b"}"
        if type(value) is torch.Tensor:  # noqa: E721
            return repr(_tensor_digest(value)).encode()
        raise _NotCanonical


@dataclasses.dataclass
class ObjectReport:
    rank: int
    digests: dict[str, Digest]  # key -> digest of this rank's value
    copies: dict[str, StoredItem] = dataclasses.field(default_factory=dict)  # keep_per_rank: where this rank's value is
    mesh: MeshRecord | None = None  # the mesh of the first DTensor this rank saves
    #: a tiered save against a base still draining: where this rank's items that reference it lie whole
    full_copy: dict[MetadataIndex, StoredItem] | None = None


def attach_report(results: list[WriteResult], report: ObjectReport) -> list[WriteResult]:
    return [*results, WriteResult(index=MetadataIndex(_REPORT_KEY), size_in_bytes=0, storage_data=report)]


def split_reports(results: list[list[WriteResult]]) -> tuple[list[list[WriteResult]], list[ObjectReport]]:
    """Every rank's write results without the reports, and the reports (each the last of its rank's
    results, where ``attach_report`` puts it: no pass over every result)."""
    reports, stripped = [], []
    for rank_results in results:
        if rank_results and rank_results[-1].index.fqn == _REPORT_KEY:
            reports.append(rank_results[-1].storage_data)
            rank_results = rank_results[:-1]
        stripped.append(rank_results)
    return stripped, reports


def own_copies(
    held: dict[MetadataIndex, WriteItem], assigned: dict[MetadataIndex, WriteItem], policy: str
) -> dict[MetadataIndex, WriteItem]:
    """Objects this rank must also store although another rank writes them: with ``keep_per_rank``,
    every rank keeps its own value of every object it holds."""
    if policy != "keep_per_rank":
        return {}
    return {idx: it for idx, it in held.items() if it.type == WriteItemType.BYTE_IO and idx not in assigned}


def differing_keys(reports: list[ObjectReport]) -> dict[str, list[list[int]]]:
    """Keys whose value differs between ranks -> groups of ranks holding the same value."""
    last: dict[str, Digest] = {}
    for report in reports:
        last.update(report.digests)
    if all(report.digests.items() <= last.items() for report in reports):
        return {}  # every rank's value of every key is the last rank's: the common case, in C loops
    by_key: dict[str, dict[Digest, list[int]]] = defaultdict(lambda: defaultdict(list))
    for report in reports:
        for key, digest in report.digests.items():
            by_key[key][digest].append(report.rank)
    return {key: sorted(groups.values()) for key, groups in by_key.items() if len(groups) > 1}


def per_rank_values(reports: list[ObjectReport], policy: str) -> dict[str, dict[int, StoredItem]]:
    """Check the reports; return, for each differing key kept per rank, where each rank's value is."""
    differing = differing_keys(reports)
    if not differing:
        return {}
    tensors = sorted(k for k in differing if any(r.digests.get(k, ("",))[0] == "tensor" for r in reports))
    if tensors or policy != "keep_per_rank":
        keys = tensors or sorted(differing)
        key, groups = keys[0], differing[keys[0]]
        described = "; ".join(f"ranks {g}" for g in groups)
        more = f" (and {len(keys) - 1} more key(s): {keys[1:6]})" if len(keys) > 1 else ""
        kind = "tensor" if tensors else "non-tensor"
        remedy = (
            "" if tensors else ", or set WriterConfig(differing_objects='keep_per_rank') to keep one value per rank"
        )
        raise PerRankStateError(
            f"ranks hold different values under the {kind} key {key!r} ({described} each hold another value)"
            f"{more}; saving would keep one rank's value and silently lose the others. Wrap per-rank state in "
            f"ckptio.PerRank(value, dp_rank=..., dp_size=...) or give each rank its own key{remedy}"
        )
    return {key: {r.rank: r.copies[key] for r in reports if key in r.copies} for key in differing}
