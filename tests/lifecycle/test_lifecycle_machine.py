"""The checkpoint lifecycle as a stateful property: random sequences of saves (plain, tiered on one of two
node tiers, tiered with a drain that never finishes, incremental, without a coordinator, tiered with any
of these), overwrites, deletes, reused URLs, damaged and lost node copies (their data or their documents),
merges and restarts through ``ckptio.latest``, in one process, against a model of what each URL and each
node holds. Every load returns what the model says or raises a named ``CheckpointError``, never other
values; ``latest`` always names a step that loads, and never raises for a node copy.

The model's rules (what ckptio promises across time):
- a URL's checkpoint is its last committed save: ``ckptio.json`` (a save with a coordinator, a finished
  drain, a merge) or, where there is none, its complete fragment set. A save with a coordinator is refused
  (``CheckpointExistsError``) over a committed ``ckptio.json`` unless it overwrites, a save without one also
  over committed fragments, a tiered save also where its node holds a committed copy of that URL whose
  drain has not committed it (its data whole or damaged; not its document: see below);
- a node's copy is read only while nothing is committed at the URL (a drain that has not finished); a
  copy damaged or lost on the node is never a source, nor one whose drain committed it on the durable tier
  once the URL is deleted there; a node copy whose drain has not committed refuses a save to its URL
  (without ``overwrite``) until ``latest`` passes it over; a node document cut short is no copy and
  refuses nothing;
- ``latest`` on a node resumes the newest undamaged copy newer than every durable step (committing it),
  else names the newest durable step.
Lifecycles of several ranks and nodes (partner copies and node losses, requeued attempts under one
``CKPTIO_JOB_ID``, ranks killed mid-save, loads racing a merge) and real process exits are fixed examples
in ``test_one_answer.py``, ``test_outside_findings.py``, ``tests/tiers/test_exit.py`` and ``tests/tiers``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time

import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import ckptio
from ckptio.format.names import METADATA_NAME
from ckptio.storage import open_store
from ckptio.tiers.drain import drain_queue
from ckptio.tiers.paths import step_order
from ckptio.tools.cli import main as cli_main
from tests.helpers.fragment_ranks import only_fragments
from tests.helpers.tiered import flip_a_byte, is_full_copy

N = 1 << 15  # fp32 elements per tensor: past the inline limit, several blocks
STEPS = st.integers(1, 3)
TIERS = st.sampled_from(["node-a", "node-b"])
TUNING = ckptio.Tuning(max_block_size=16 << 10)
#: A drain that cannot finish: cut off after half a second.
STALLED = ckptio.Tuning(max_block_size=16 << 10, drain_timeout_s=0.5)


def _state(value: int) -> dict:
    # "base" never changes (an incremental save references it), "w" always does
    return {"base": torch.arange(float(N)), "w": torch.full((N,), float(value)), "step": value}


def _blank() -> dict:
    return {"base": torch.zeros(N), "w": torch.zeros(N), "step": -1}


def _value_of(loaded: dict) -> int:
    value = int(loaded["w"][0])
    exact = torch.equal(loaded["w"], torch.full((N,), float(value))) and loaded["step"] == value
    if not exact or not torch.equal(loaded["base"], torch.arange(float(N))):
        raise AssertionError(f"a load returned values no save wrote: step={loaded['step']}, w[0]={value}")
    return value


def _references(tier: str) -> bool:
    """Whether the newest save on the node ``tier`` references a base (it kept a full copy beside its file)."""
    newest = max((entry for entry in os.scandir(tier) for entry in os.scandir(entry)), key=lambda e: e.stat().st_mtime)
    return any(is_full_copy(name) for name in os.listdir(newest))


class HeldDrain:
    """A job at the head of the drain queue that holds the uploads queued behind it until ``release()``."""

    def __init__(self) -> None:
        self._released = threading.Event()
        drain_queue().submit("held", self, timeout_s=120)

    def run(self, deadline: float) -> None:
        self._released.wait(max(0.0, deadline - time.monotonic()))

    def release(self) -> None:
        self._released.set()


class Lifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="ckptio-lifecycle-")
        self.run = os.path.join(self.root, "run")
        self.durable: dict[int, tuple[int, str]] = {}  # step -> (value, "json" or "fragments")
        self.node: dict[tuple[str, int], int] = {}  # (tier, step) -> value of the node's whole copy
        # a node copy's document, whole or damaged, whose drain has not committed it (a save there is refused)
        self.node_commits: set[tuple[str, int]] = set()
        self.node_drained: set[tuple[str, int]] = set()  # a node copy its drain committed on the durable tier
        self.counter = 0

    def teardown(self) -> None:
        try:
            ckptio.wait_for_uploads(timeout=60)
        except ckptio.DrainError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)

    # --- helpers ----------------------------------------------------------------------------
    def _url(self, step: int) -> str:
        return f"{self.run}/step-{step}"

    def _tier(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _next_value(self) -> int:
        self.counter += 1
        return self.counter

    def _save(self, step: int, config: ckptio.WriterConfig, refused: bool, **kwargs) -> int | None:
        value = self._next_value()
        try:
            dcp.save(_state(value), storage_writer=ckptio.Writer(self._url(step), config), **kwargs)
        except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException
            error = ckptio.unwrap(exc)
            assert refused and isinstance(error, ckptio.CheckpointExistsError), f"save refused: {error!r}"
            return None
        assert not refused, f"a save over a committed checkpoint at step {step} was not refused"
        return value

    def _json_committed(self, step: int) -> bool:
        return self.durable.get(step, (None, ""))[1] == "json"

    # --- saves ------------------------------------------------------------------------------
    @rule(step=STEPS, overwrite=st.booleans(), incremental=st.booleans())
    def save(self, step, overwrite, incremental):
        config = ckptio.WriterConfig(
            overwrite=overwrite, tuning=TUNING, incremental_from="previous" if incremental else None
        )
        value = self._save(step, config, refused=self._json_committed(step) and not overwrite)
        if value is not None:
            self.durable[step] = (value, "json")

    @rule(step=STEPS, overwrite=st.booleans(), dies_after_save=st.booleans(), incremental=st.booleans())
    def save_without_coordinator(self, step, overwrite, dies_after_save, incremental):
        config = ckptio.WriterConfig(
            overwrite=overwrite, tuning=TUNING, incremental_from="previous" if incremental else None
        )
        refused = step in self.durable and not overwrite
        value = self._save(step, config, refused, use_collectives=False)
        if value is None:
            return
        ckptio.wait_for_uploads()  # rank 0 merged the fragments into ckptio.json
        if incremental:
            chain = json.loads(open_store(self._url(step)).read(METADATA_NAME)).get("chain")
            event(f"save without a coordinator: incremental, {'references a base' if chain else 'in full'}")
        if dies_after_save:  # ... or the job died first: the loads merge them
            only_fragments(self._url(step))
        self.durable[step] = (value, "fragments" if dies_after_save else "json")

    @rule(
        tier=TIERS,
        step=STEPS,
        overwrite=st.booleans(),
        drain_finishes=st.booleans(),
        incremental=st.booleans(),
        collectives=st.booleans(),
    )
    def tiered_save(self, tier, step, overwrite, drain_finishes, incremental, collectives):
        stall = {"tuning": TUNING} if drain_finishes else {"drain_bandwidth": 1, "tuning": STALLED}
        config = ckptio.WriterConfig(
            local_tier=self._tier(tier),
            local_tier_keep=10,
            overwrite=overwrite,
            incremental_from="previous" if incremental else None,
            **stall,
        )
        committed = self._json_committed(step) if collectives else step in self.durable
        refused = not overwrite and (committed or (tier, step) in self.node_commits)
        value = self._save(step, config, refused, use_collectives=collectives)
        event(f"tiered save: {'refused' if value is None else 'drained' if drain_finishes else 'drain stalled'}")
        if value is None:
            return
        event(f"tiered save: {'with' if collectives else 'without'} a coordinator")
        if incremental:
            event(f"tiered save: incremental, {'references a base' if _references(self._tier(tier)) else 'in full'}")
        self.node[(tier, step)] = value
        if drain_finishes:
            ckptio.wait_for_uploads()
            self.durable[step] = (value, "json")
            self.node_commits.discard((tier, step))
            self.node_drained.add((tier, step))
        else:
            self.node_commits.add((tier, step))
            self.node_drained.discard((tier, step))
            try:
                ckptio.wait_for_uploads()
                raise AssertionError("a drain at 1 byte/s finished within 0.5 s")
            except ckptio.DrainError:
                pass

    @rule(tier=TIERS, first=st.integers(1, 2), damaged=st.booleans(), delete=st.none() | STEPS)
    def saves_while_the_drain_lags(self, tier, first, damaged, delete):
        """Two tiered incremental saves back to back while the drain is held (``HeldDrain``): the second
        references the first while it waits to upload (issue 66). ``damaged``: the first's node file is
        damaged before its upload, so its drain fails and the second is committed full from its node's full
        copy; ``delete``: a step deleted while both wait (a base they reference keeps its files)."""
        config = ckptio.WriterConfig(
            local_tier=self._tier(tier), local_tier_keep=10, incremental_from="previous", tuning=TUNING
        )
        held = HeldDrain()
        saved = []
        for step in (first, first + 1):
            refused = not config.overwrite and (self._json_committed(step) or (tier, step) in self.node_commits)
            saved.append(self._save(step, config, refused))
        if damaged and saved[0] is not None:
            folder = next(top for top, _, _ in os.walk(self._tier(tier)) if top.endswith(f"step-{first}"))
            for name in [n for n in os.listdir(folder) if n.endswith(".ckio")]:
                flip_a_byte(os.path.join(folder, name))
        if delete is not None and delete not in (first, first + 1):
            self.delete(delete)
        held.release()
        try:
            ckptio.wait_for_uploads()
        except ckptio.DrainError:
            assert damaged, "a drain failed that nothing damaged"
        event(f"saves while the drain lags: {'base damaged' if damaged else 'drained'}")
        if saved[1] is not None and saved[0] is not None:
            chain = json.loads(open_store(self._url(first + 1)).read(METADATA_NAME)).get("chain")
            base = chain and chain["base"] if not (damaged and saved[0] is not None) else "(rebased)"
            base = "the first" if base == f"step-{first}" else base
            event(f"saves while the drain lags: the second's base: {base}")
        for step, value in zip((first, first + 1), saved, strict=True):
            if value is None:
                continue
            if damaged and step == first:  # its drain refused the damaged copy: never durable, no copy
                self.node.pop((tier, step), None)
                self.node_commits.add((tier, step))
                self.node_drained.discard((tier, step))
                continue
            self.node[(tier, step)] = value
            self.durable[step] = (value, "json")
            self.node_commits.discard((tier, step))
            self.node_drained.add((tier, step))

    # --- time: deletes, merges, damage, lost nodes ----------------------------------------------
    @rule(step=STEPS)
    def delete(self, step):
        code = cli_main(["delete", "--force", self._url(step)])
        assert code == 0 or step not in self.durable, f"ckptio delete exited {code}"
        self.durable.pop(step, None)
        for copy in [copy for copy in self.node_drained if copy[1] == step]:  # deleted where it was committed
            self.node.pop(copy, None)
            self.node_drained.discard(copy)

    @precondition(lambda self: any(kind == "fragments" for _, kind in self.durable.values()))
    @rule(data=st.data())
    def merge(self, data):
        step = data.draw(st.sampled_from(sorted(s for s, (_, kind) in self.durable.items() if kind == "fragments")))
        assert cli_main(["merge", self._url(step)]) == 0
        self.durable[step] = (self.durable[step][0], "json")

    @precondition(lambda self: self.node)
    @rule(data=st.data())
    def damage_a_node_copy(self, data):
        tier, step = data.draw(st.sampled_from(sorted(self.node)))
        folder = next((top for top, dirs, files in os.walk(self._tier(tier)) if top.endswith(f"step-{step}")), None)
        files = sorted(f for f in os.listdir(folder) if f.endswith(".ckio")) if folder else []
        for name in files:  # an overwrite leaves the replaced copy's files beside the new one's: all of them
            flip_a_byte(os.path.join(folder, name))
        if not files:
            return
        del self.node[(tier, step)]  # no longer a copy of anything

    @precondition(lambda self: self.node_commits or self.node)
    @rule(data=st.data())
    def damage_a_node_document(self, data):
        """A node's ``ckptio.json`` or fragment cut short (a disk that lost its tail): no longer a copy of
        anything, and no reason to refuse a save (issue 65, finding 4: ``latest`` raised on it)."""
        tier, step = data.draw(st.sampled_from(sorted(self.node_commits | set(self.node))))
        folder = next((top for top, _, _ in os.walk(self._tier(tier)) if top.endswith(f"step-{step}")), None)
        names = [n for n in os.listdir(folder) if n == METADATA_NAME or n.startswith("ckptio.rank-")] if folder else []
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
        if names:
            event("node document damaged")
            self.node.pop((tier, step), None)
            self.node_commits.discard((tier, step))

    @rule(tier=TIERS)
    def lose_a_node(self, tier):
        shutil.rmtree(self._tier(tier), ignore_errors=True)
        self.node = {key: value for key, value in self.node.items() if key[0] != tier}
        self.node_commits = {key for key in self.node_commits if key[0] != tier}
        self.node_drained = {key for key in self.node_drained if key[0] != tier}

    # --- loads and restarts -----------------------------------------------------------------
    def _expected(self, step: int, tier: str | None) -> int | None:
        if step in self.durable:
            return self.durable[step][0]
        return self.node.get((tier, step)) if tier else None

    def _load(self, step: int, tier: str | None) -> int | None:
        loaded = _blank()
        reader = ckptio.Reader(self._url(step), local_tier=self._tier(tier) if tier else None)
        try:
            dcp.load(loaded, storage_reader=reader, planner=ckptio.SafeLoadPlanner())
        except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException
            error = ckptio.unwrap(exc)
            assert isinstance(error, ckptio.CheckpointError), f"unnamed error: {error!r}"
            return None
        return _value_of(loaded)

    @rule(step=STEPS, tier=st.none() | TIERS)
    def load(self, step, tier):
        if step in self.durable:
            event(f"load: committed ({self.durable[step][1]}){', a node tier given' if tier else ''}")
        else:
            event("load: a node's copy alone" if (tier, step) in self.node else "load: nothing to load (an error)")
        assert self._load(step, tier) == self._expected(step, tier), (step, tier, self.durable, self.node)

    @rule(tier=st.none() | TIERS)
    def restart(self, tier):
        newest_durable = max(self.durable, default=None)
        resumable = [
            step
            for (node, step), _ in self.node.items()
            if node == tier and (newest_durable is None or step > newest_durable)
        ]
        url = ckptio.latest(self.run, local_tier=self._tier(tier) if tier else None)
        event(f"restart: {'resumes a node copy' if resumable else 'a durable step' if self.durable else 'nothing'}")
        named = max(resumable, default=None)
        # latest passes over the node's newer documents it does not resume: a save there is not refused
        self.node_commits -= {
            (node, step)
            for node, step in self.node_commits
            if node == tier and step != named and (newest_durable is None or step > newest_durable)
        }
        if resumable:
            step = max(resumable)
            assert url == self._url(step), (url, step, self.durable, self.node)
            ckptio.wait_for_uploads()  # the resumed drain commits the node's copy
            self.durable[step] = (self.node[(tier, step)], "json")
            self.node_commits.discard((tier, step))
            self.node_drained.add((tier, step))
        elif newest_durable is None:
            assert url is None, url
            return
        else:
            assert url == self._url(newest_durable), (url, newest_durable, self.durable)
        step = int(url.rsplit("-", 1)[1])
        assert self._load(step, tier) == self._expected(step, tier)

    @invariant()
    def steps_sort_by_number(self):
        assert sorted(["step-3", "step-10"], key=step_order) == ["step-3", "step-10"]


Lifecycle.TestCase.settings = settings(
    max_examples=int(os.environ.get("CKPTIO_LIFECYCLE_EXAMPLES", 40)),
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
test_checkpoint_lifecycle = Lifecycle.TestCase
