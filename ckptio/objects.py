"""Non-tensor items held by several ranks: torch keeps one rank's value and drops the rest, so
ckptio compares what every rank holds under each key and fails the save when they differ
(or, with ``differing_objects="keep_per_rank"``, keeps every rank's value).

Each rank's findings travel to the coordinator as an ``ObjectReport`` riding along with its
write results; ``attach_report`` and ``split_reports`` are the only code that knows how.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from .errors import PerRankStateError
from .layout import MeshRecord, StoredItem

#: Index name of the per-rank report riding along with a rank's write results.
_REPORT_KEY = "__ckptio_object_report__"


@dataclasses.dataclass
class ObjectReport:
    rank: int
    digests: dict[str, tuple[int, int]]  # key -> (crc32c, length) of the pickled value
    copies: dict[str, StoredItem] = dataclasses.field(default_factory=dict)  # keep_per_rank: where this rank's value is
    mesh: MeshRecord | None = None  # the mesh of the first DTensor this rank saves


def attach_report(results: list[WriteResult], report: ObjectReport) -> list[WriteResult]:
    return [*results, WriteResult(index=MetadataIndex(_REPORT_KEY), size_in_bytes=0, storage_data=report)]


def split_reports(results: list[list[WriteResult]]) -> tuple[list[list[WriteResult]], list[ObjectReport]]:
    """Every rank's write results without the reports, and the reports."""
    reports = [r.storage_data for rank_results in results for r in rank_results if r.index.fqn == _REPORT_KEY]
    return [[r for r in rank_results if r.index.fqn != _REPORT_KEY] for rank_results in results], reports


def own_copies(held: list[WriteItem], assigned: list[WriteItem], policy: str) -> list[WriteItem]:
    """Objects this rank must also store although another rank writes them: with ``keep_per_rank``,
    every rank keeps its own value of every object it holds."""
    if policy != "keep_per_rank":
        return []
    written = {it.index for it in assigned}
    return [it for it in held if it.index not in written]


def differing_keys(reports: list[ObjectReport]) -> dict[str, list[list[int]]]:
    """Keys whose value differs between ranks -> groups of ranks holding the same value."""
    by_key: dict[str, dict[tuple[int, int], list[int]]] = defaultdict(lambda: defaultdict(list))
    for report in reports:
        for key, digest in report.digests.items():
            by_key[key][digest].append(report.rank)
    return {key: sorted(groups.values()) for key, groups in by_key.items() if len(groups) > 1}


def per_rank_values(reports: list[ObjectReport], policy: str) -> dict[str, dict[int, StoredItem]]:
    """Check the reports; return, for each differing key kept per rank, where each rank's value is."""
    differing = differing_keys(reports)
    if not differing:
        return {}
    if policy != "keep_per_rank":
        key, groups = next(iter(sorted(differing.items())))
        described = "; ".join(f"ranks {g}" for g in groups)
        more = f" (and {len(differing) - 1} more key(s): {sorted(differing)[1:6]})" if len(differing) > 1 else ""
        raise PerRankStateError(
            f"ranks hold different values under the non-tensor key {key!r} ({described} each hold another value)"
            f"{more}; saving would keep one rank's value and silently lose the others. Wrap per-rank state in "
            "ckptio.PerRank(value, dp_rank=..., dp_size=...), give each rank its own key, or set "
            "WriterConfig(differing_objects='keep_per_rank') to store one value per rank"
        )
    return {key: {r.rank: r.copies[key] for r in reports if key in r.copies} for key in differing}
