"""Whether a node's copy of a step is still the last save to its URL: what the node noted beside the copy,
and the one rule every reader of node copies applies to it (``ckptio.latest``, a tiered load, a tiered
save's refusal).

A node document (``ckptio.json``, or a rank's fragment, of a step folder on the fast tier; its own or a
partner's copy) stands in for its URL only while it is *live*:

- no save to the URL has begun on any node of the job since it was committed: each rank notes in its
  node's step folder when a tiered save there began writing (``ckptio.note-begun``), so a later save that
  never committed still shows (a partner node kept an older document, the node that held the newer one was
  lost);
- it has not reached the durable tier and been deleted there since: the drain notes each document it
  commits on the durable tier (``ckptio.note-durable-<save id>-<name>``); one so noted that the durable
  tier no longer holds was deleted (or replaced), and is never served again;
- ``ckptio.latest`` has not passed it over: a step it passes over (incomplete, damaged, mixed, deleted or
  superseded) is noted on every node that holds it (``ckptio.note-passed-<digest>``), so a job resuming from
  an older step saves this one again without ``overwrite`` and ``ckptio gc --local-tier`` removes it.

Notes are empty files (or one number) named for what they say: ranks of one node write them without
locks, and a step folder's removal takes them along. Clocks of different nodes compare within
``CLOCK_SKEW_S``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from typing import Any, Iterable

from ckptio.format.names import METADATA_NAME, parse_fragment_name

log = logging.getLogger(__name__)

NOTE_PREFIX = "ckptio.note-"
BEGUN = NOTE_PREFIX + "begun"
_DURABLE = re.compile(re.escape(NOTE_PREFIX) + r"durable-([0-9a-f]{1,64})-(.+)")
_PASSED = re.compile(re.escape(NOTE_PREFIX) + r"passed-([0-9a-f]{32})")
#: Nodes' clocks may differ this much (NTP keeps them within milliseconds); a save begins seconds after the
#: one before it commits.
CLOCK_SKEW_S = 0.5


def is_note(name: str) -> bool:
    return os.path.basename(name).startswith(NOTE_PREFIX)


def digest(document: bytes) -> str:
    return hashlib.blake2b(document, digest_size=16).hexdigest()


@dataclasses.dataclass(frozen=True)
class NodeDocument:
    """A node document's identity: its bytes' digest, and its header's save id and creation time (``None``
    and 0 where it does not parse: a damaged document is passed over by those who read it)."""

    digest: str
    save_id: str | None
    created_unix: float


@dataclasses.dataclass(frozen=True)
class NodeStep:
    """What one node holds of a step's documents (those ``latest`` has not passed over), and its notes."""

    documents: dict[str, NodeDocument] = dataclasses.field(default_factory=dict)  # name -> identity
    begun: float = 0.0  # when the newest save to the URL began writing here (0: none noted)
    begun_save: str | None = None  # its save id, where its ranks share one (a save without a coordinator)
    durable: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)  # save id -> names committed

    @property
    def held(self) -> str | None:
        """``ckptio.json``, ``"fragments"`` or ``None``: which kind of document the node holds live."""
        if METADATA_NAME in self.documents:
            return METADATA_NAME
        return "fragments" if self.documents else None


def step_folder(local: Any) -> str:
    """The node's step folder that ``local`` (a local store of it) is."""
    return os.path.dirname(local.path(METADATA_NAME))


def node_step(folder: str) -> NodeStep:
    """What the node's step folder holds and noted (empty where there is no folder)."""
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return NodeStep()
    passed = {m[1] for name in names if (m := _PASSED.fullmatch(name))}
    durable: dict[str, set[str]] = {}
    for name in names:
        if m := _DURABLE.fullmatch(name):
            durable.setdefault(m[1], set()).add(m[2])
    documents = {}
    for name in names:
        if name == METADATA_NAME or parse_fragment_name(name) is not None:
            identity = _identity(os.path.join(folder, name))
            if identity is not None and identity.digest not in passed:
                documents[name] = identity
    begun, begun_save = _begun(folder)
    return NodeStep(documents, begun, begun_save, {k: frozenset(v) for k, v in durable.items()})


def _identity(path: str) -> NodeDocument | None:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    save_id, created = None, 0.0
    try:
        header = json.loads(raw)
        save_id, created = header.get("save_id"), header.get("created_unix", 0.0)
        if not isinstance(save_id, str) or not isinstance(created, (int, float)):
            save_id, created = None, 0.0
    except (ValueError, AttributeError):  # damaged: its readers pass it over by name
        pass
    return NodeDocument(digest(raw), save_id, float(created))


def _begun(folder: str) -> tuple[float, str | None]:
    try:
        with open(os.path.join(folder, BEGUN)) as f:
            when, _, save_id = f.read().strip().partition(" ")
        return float(when), save_id or None
    except (OSError, ValueError):
        return 0.0, None


def superseded(document: NodeDocument, steps: Iterable[NodeStep]) -> bool:
    """Whether another save to the URL began on some node after ``document`` was committed (a rank of its own
    save without a coordinator may begin after another rank committed its fragment)."""
    return any(
        step.begun > document.created_unix + CLOCK_SKEW_S and step.begun_save != document.save_id for step in steps
    )


def deleted(document: NodeDocument, steps: Iterable[NodeStep], durable_names: Any) -> bool:
    """Whether ``document``'s save reached the durable tier (a node noted it) and the durable tier no longer
    holds what was noted there (``durable_names``: the names it holds now, a container)."""
    if document.save_id is None:
        return False
    noted = {name for step in steps for name in step.durable.get(document.save_id, ())}
    return any(name not in durable_names for name in noted)


def live(document: NodeDocument, steps: list[NodeStep], durable_names: Any) -> bool:
    """The rule: ``document`` stands in for its URL (``steps``: every node's view of the step)."""
    return (
        document.save_id is not None and not superseded(document, steps) and not deleted(document, steps, durable_names)
    )


def note_begun(folder: str, started_unix: float, save_id: str | None = None) -> None:
    """A tiered save to this step (of ``save_id``, where its ranks share one) began writing on this node,
    before its first byte lands here."""
    _write(folder, BEGUN, f"{started_unix:.6f} {save_id or ''}".strip())


def note_durable(folder: str, save_id: str | None, name: str) -> None:
    """The document ``name`` of save ``save_id`` (whose copy the node holds) is committed on the durable tier."""
    if save_id and re.fullmatch(r"[0-9a-f]{1,64}", save_id):
        _write(folder, f"{NOTE_PREFIX}durable-{save_id}-{name}", "")


def note_passed_over(folder: str, documents: Iterable[NodeDocument]) -> None:
    """``ckptio.latest`` passed these documents of the node's step folder over."""
    for document in documents:
        _write(folder, f"{NOTE_PREFIX}passed-{document.digest}", "")


def _write(folder: str, name: str, text: str) -> None:
    """A note, written whole (a temporary name renamed); a folder that is gone or full is not noted."""
    path = os.path.join(folder, name)
    partial = f"{path}.partial-{os.getpid()}"
    try:
        with open(partial, "w") as f:
            f.write(text)
        os.replace(partial, path)
    except OSError as exc:
        log.debug("ckptio: cannot note %s: %s", path, exc)
        try:
            os.remove(partial)
        except OSError:
            pass
