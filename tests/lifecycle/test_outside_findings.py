"""Issue 50's findings, each as a fixed example run every time: what outside suites found at the seams
between features and across time (a node's stale copy, a requeued job's fragments, a damaged node copy,
hostile integers)."""

from __future__ import annotations

import base64
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.tools.cli import main as cli_main
from tests.helpers.tiered import flip_a_byte

N = 1 << 15  # elements: 128 KiB of fp32, past the metadata's inline limit, so data files are written


def _tiered(tier) -> ckptio.WriterConfig:
    return ckptio.WriterConfig(local_tier=str(tier))


def test_a_node_s_stale_copy_is_never_loaded_after_the_url_is_deleted_and_saved_again(tmp_path):
    """Finding 1: the node still holds step-1's old copy; the URL now holds another checkpoint."""
    run, tier = str(tmp_path / "run"), tmp_path / "tier"
    ckptio.save({"w": torch.zeros(4)}, f"{run}/step-1", _tiered(tier))
    ckptio.wait_for_uploads()
    assert cli_main(["delete", f"{run}/step-1"]) == 0
    ckptio.save({"w": torch.ones(4)}, f"{run}/step-1")
    for reader in (ckptio.Reader(f"{run}/step-1", local_tier=str(tier)), ckptio.Reader(f"{run}/step-1")):
        state = {"w": torch.full((4,), 7.0)}
        dcp.load(state, storage_reader=reader)
        assert torch.equal(state["w"], torch.ones(4))
    assert ckptio.latest(run, local_tier=str(tier)) == f"{run}/step-1"


def test_a_node_s_copy_overwritten_by_another_job_is_never_loaded(tmp_path):
    """Finding 1, an overwrite from other nodes: a second tier stands for them."""
    run, mine, theirs = str(tmp_path / "run"), tmp_path / "mine", tmp_path / "theirs"
    big = {"w": torch.arange(float(N))}
    ckptio.save(big, f"{run}/step-1", _tiered(mine))
    ckptio.wait_for_uploads()
    other = {"w": -torch.arange(float(N))}
    ckptio.save(other, f"{run}/step-1", ckptio.WriterConfig(local_tier=str(theirs), overwrite=True))
    ckptio.wait_for_uploads()
    state = {"w": torch.zeros(N)}
    reader = ckptio.Reader(f"{run}/step-1", local_tier=str(mine))
    dcp.load(state, storage_reader=reader)
    assert torch.equal(state["w"], other["w"])
    assert reader.bytes_read["local"] == 0


def test_pruning_keeps_a_node_copy_that_the_durable_tier_does_not_hold(tmp_path):
    """Finding 1's blind spot in pruning: a durable ckptio.json of another save at a step is not this
    node's copy. Step 1 is committed on S3 by another job; this node's newer step 1 (an overwrite whose
    drain ran out of time) must stay when step 2 prunes, and a copy the durable tier holds must go."""
    run, tier = str(tmp_path / "run"), tmp_path / "tier"
    ckptio.save({"w": torch.zeros(N)}, f"{run}/step-1")  # committed durably, never on this node
    stalled = ckptio.WriterConfig(
        local_tier=str(tier), overwrite=True, drain_bandwidth=1, tuning=ckptio.Tuning(drain_timeout_s=0.5)
    )
    ckptio.save({"w": torch.ones(N)}, f"{run}/step-1", stalled)
    with pytest.raises(ckptio.DrainError):
        ckptio.wait_for_uploads()
    steps = os.path.join(str(tier), os.listdir(tier)[0])
    for step in (2, 3):
        ckptio.save({"w": torch.full((N,), float(step))}, f"{run}/step-{step}", _keep_one(tier))
        ckptio.wait_for_uploads()
    assert sorted(os.listdir(steps)) == ["step-1", "step-3"]  # step 2 was on S3: pruned; step 1 was not
    state = {"w": torch.zeros(N)}
    ckptio.load(state, f"{run}/step-1")
    assert torch.equal(state["w"], torch.zeros(N))  # S3 still holds the other job's step 1


def _keep_one(tier) -> ckptio.WriterConfig:
    return ckptio.WriterConfig(local_tier=str(tier), local_tier_keep=1)


def test_latest_never_names_a_step_whose_only_copy_is_damaged(tmp_path):
    """Finding 3: a byte of step 2's fast-tier file flipped after the save; its drain refuses it. A new
    job's latest must answer step 1 (committed on the durable tier), not step 2, and leave nothing
    running that a process would wait for at exit."""
    run, tier = str(tmp_path / "run"), tmp_path / "tier"
    slow = ckptio.WriterConfig(local_tier=str(tier), drain_bandwidth=400_000)
    ckptio.save({"w": torch.ones(N)}, f"{run}/step-1", slow)
    ckptio.save({"w": torch.full((N,), 2.0)}, f"{run}/step-2", _tiered(tier))  # drains behind step 1
    step_2 = os.path.join(str(tier), os.listdir(tier)[0], "step-2")
    (data,) = [name for name in os.listdir(step_2) if name.endswith(".ckio")]
    flip_a_byte(os.path.join(step_2, data))
    with pytest.raises(ckptio.DrainError, match="fails its CRC32C"):
        ckptio.wait_for_uploads()
    assert ckptio.latest(run, local_tier=str(tier)) == f"{run}/step-1"
    assert ckptio.uploads_pending() == 0
    state = {"w": torch.zeros(N)}
    dcp.load(state, storage_reader=ckptio.Reader(f"{run}/step-1", local_tier=str(tier)))
    assert torch.equal(state["w"], torch.ones(N))


def _save_with_a_damaged_rank_file(run: str, tier_base: str) -> tuple[str, float]:
    """On 2 ranks, each its own node tier: rank 1's file is damaged before its upload, which refuses it.
    The coordinator's commit must end at once (drain_timeout_s is an hour), not poll for that file."""
    import time

    import torch.distributed as dist

    rank = dist.get_rank()
    tier = os.path.join(tier_base, f"node{rank}")
    slow = ckptio.WriterConfig(local_tier=tier, drain_bandwidth=None if rank == 0 else 400_000)
    dcp.save({f"w{rank}": torch.arange(float(N)) + rank * N}, storage_writer=ckptio.Writer(f"{run}/step-0", slow))
    config = ckptio.WriterConfig(local_tier=tier)  # rank 1's drain of it waits behind step 0's
    dcp.save({f"w{rank}": torch.arange(float(N)) + rank * N}, storage_writer=ckptio.Writer(f"{run}/step-1", config))
    if rank == 1:
        step = os.path.join(tier, os.listdir(tier)[0], "step-1")
        (data,) = [name for name in os.listdir(step) if name.endswith(".ckio") and f"-r{rank:05d}" in name]
        flip_a_byte(os.path.join(step, data))
    start = time.monotonic()
    try:
        ckptio.wait_for_uploads()
        outcome = "drained"
    except ckptio.DrainError as exc:
        outcome = str(exc)
    waited = time.monotonic() - start
    # The same step saved again over the refused one: its note is an earlier save's, so rank 1, which awaits
    # the commit past its first listings (rank 0's upload is slowed to ~3 s), must not take it for its own.
    time.sleep(1.0)  # a later save: more than REFUSAL_CLOCK_SKEW_S after the refusal
    slow = ckptio.WriterConfig(local_tier=tier, overwrite=True, drain_bandwidth=40_000 if rank == 0 else None)
    dcp.save({f"w{rank}": torch.arange(float(N)) - rank}, storage_writer=ckptio.Writer(f"{run}/step-1", slow))
    try:
        ckptio.wait_for_uploads()
        again = "drained"
    except ckptio.DrainError as exc:
        again = str(exc)
    return outcome, waited, again


def test_a_refused_file_ends_the_commit_that_waits_for_it(tmp_path):
    """Finding 3's second half, as a class: background work has a bound that a refused file ends."""
    from torch.distributed.tensor import Shard, distribute_tensor  # noqa: F401 - a plain replicated state

    from tests.helpers.harness import spawn

    outcomes = spawn(2, _save_with_a_damaged_rank_file, str(tmp_path / "run"), str(tmp_path / "tiers"), timeout=120)
    (coordinator, waited, again_0), (refused, _, again_1) = outcomes
    assert "fails its CRC32C" in refused
    assert "was refused by its drain" in coordinator and waited < 30, outcomes
    assert again_0 == again_1 == "drained", outcomes
    state = {"w0": torch.zeros(N), "w1": torch.zeros(N)}
    ckptio.load(state, str(tmp_path / "run" / "step-1"))
    assert torch.equal(state["w0"], torch.arange(float(N))) and torch.equal(state["w1"], torch.arange(float(N)) - 1)


def _save_without_coordinator(url: str, value: float) -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    try:
        dcp.save({f"w{rank}": torch.full((N,), value)}, storage_writer=ckptio.Writer(url), use_collectives=False)
        return "saved"
    except ckptio.CheckpointExistsError:
        return "exists"
    except RuntimeError:  # the barrier that ends dcp.save, after this rank's fragment committed: rank 0 left
        return "saved, barrier failed"


def test_a_requeued_job_s_fragments_never_complete_an_earlier_attempt_s_set(tmp_path):
    """Finding 2: with CKPTIO_JOB_ID kept across a requeue, attempt 1's rank 1 died before committing its
    fragment; attempt 2 saves the step again with other values. Its ranks used to decide alone (rank 0 found
    its fragment taken and was refused, rank 1 committed: a set of two attempts). Attempt 1's set never
    completed, so every rank of attempt 2 replaces its fragment (issue 65, finding 6): the set is attempt
    2's alone, and loads and ``ckptio merge`` read its values, never attempt 1's."""
    from ckptio.format.names import fragment_name
    from tests.helpers.fragment_ranks import only_fragments
    from tests.helpers.harness import spawn

    url = str(tmp_path / "step-7")
    env = {"CKPTIO_JOB_ID": "slurm-4242"}
    assert spawn(2, _save_without_coordinator, url, 1.0, env=env) == ["saved", "saved"]
    os.remove(os.path.join(url, fragment_name(1, 2)))  # rank 1 was killed before its fragment committed,
    only_fragments(url)  # so rank 0 never merged the set
    assert spawn(2, _save_without_coordinator, url, 2.0, env=env) == ["saved", "saved"]
    only_fragments(url)  # the set as attempt 2 left it, merged by the loads
    state = {"w0": torch.zeros(N), "w1": torch.zeros(N)}
    ckptio.load(state, url)
    assert torch.equal(state["w0"], torch.full((N,), 2.0)) and torch.equal(state["w1"], torch.full((N,), 2.0))
    assert cli_main(["merge", url]) == 0
    # and a complete set of one save refuses every rank of a save without overwrite, alike
    assert spawn(2, _save_without_coordinator, url, 3.0, env=env) == ["exists", "exists"]


def _packed_8_bytes(*values: int) -> str:
    import struct

    return "Q" + base64.b64encode(struct.pack(f"<{len(values)}Q", *values)).decode()


def _metadata(tmp_path) -> dict:
    ckptio.save({"w": torch.arange(float(N)), "v": torch.arange(float(N)) * 2}, str(tmp_path / "ck"))
    with open(tmp_path / "ck" / "ckptio.json") as f:
        return json.load(f)


@pytest.mark.parametrize("value", [1 << 63, (1 << 64) - 1])
def test_packed_8_byte_entries_past_2_63_are_refused_on_every_platform(value):
    """Finding 5: the bound was tested for the array typecode 'Q', and 8-byte arrays are 'L' on 64-bit
    Linux: a chunk offset of 2^63 became an OverflowError in the read (a StorageError inviting a retry)."""
    from ckptio.errors import CheckpointFormatError
    from ckptio.format.columns import PackedBlocks, decode_array, decode_column

    column = _packed_8_bytes(3, value)
    for decode in (decode_column, decode_array):
        with pytest.raises(CheckpointFormatError, match="past the largest"):
            decode(column, 2, "a column")
    with pytest.raises(CheckpointFormatError, match="past the largest"):
        PackedBlocks(column, 2, "a column")[1:]


@pytest.mark.parametrize(
    "field, value",
    [
        (("files", "ranks"), _packed_8_bytes(1 << 63)),
        (("files", "sizes"), _packed_8_bytes(1 << 63)),
        (("files", "save_ids"), [1234567890123456]),  # a number that would spell a valid file name
        (("files", "save_ids"), [True]),
        (("save_id",), 1234567890123456),
    ],
)
def test_integers_and_save_ids_of_the_wrong_kind_are_named_format_errors(tmp_path, field, value):
    """Finding 5: an integer column is bounded by value; a save id is a string, never a number."""
    from ckptio.errors import CheckpointFormatError
    from ckptio.format.document import decode_metadata

    doc = _metadata(tmp_path)
    target = doc
    for part in field[:-1]:
        target = target[part]
    target[field[-1]] = value
    with pytest.raises(CheckpointFormatError):
        decode_metadata(json.dumps(doc).encode(), "ckptio.json")
    with open(tmp_path / "ck" / "ckptio.json", "w") as f:
        json.dump(doc, f)
    assert cli_main(["inspect", str(tmp_path / "ck")]) != 0
    assert cli_main(["verify", str(tmp_path / "ck")]) != 0


def test_digest_entries_wider_than_4_bytes_are_refused(tmp_path):
    """Finding 5's digests: a base's block digests are sliced as 4-byte entries; 8-byte ones would shift
    every block's digest against the blocks a later incremental save compares."""
    import struct

    from ckptio.errors import CheckpointFormatError
    from ckptio.format.document import decode_metadata

    url = str(tmp_path / "run" / "step-1")
    ckptio.save({"w": torch.arange(float(N))}, url, ckptio.WriterConfig(incremental_from="previous"))
    with open(os.path.join(url, "ckptio.json")) as f:
        doc = json.load(f)
    entries = base64.b64decode(doc["blocks"]["digests"][1:])
    words = struct.unpack(f"<{len(entries) // 4}I", entries)
    doc["blocks"]["digests"] = "Q" + base64.b64encode(struct.pack(f"<{len(words)}Q", *words)).decode()
    with pytest.raises(CheckpointFormatError, match="digests"):
        decode_metadata(json.dumps(doc).encode(), "ckptio.json")


def test_a_config_field_set_after_construction_is_checked_when_the_save_starts(tmp_path):
    """Finding 6: WriterConfig's refusals held at construction only; a field set afterwards bypassed them."""
    config = ckptio.WriterConfig(incremental_from="previous")
    config.local_tier = "s3://bucket/tier"
    url = str(tmp_path / "run" / "step-1")
    with pytest.raises(BaseException) as raised:  # noqa: PT011 - dcp.save wraps it in torch's CheckpointException
        dcp.save({"w": torch.ones(N)}, storage_writer=ckptio.Writer(url, config))
    assert "ValueError: local_tier must be a node-local path" in str(ckptio.unwrap(raised.value))
    config = ckptio.WriterConfig()
    with pytest.warns(DeprecationWarning, match="tuning.max_block_size"):
        config.max_block_size = 100  # not a multiple of 64; the pre-1.0 name of tuning.max_block_size
    with pytest.raises(ckptio.CheckpointError, match="ValueError: max_block_size"):
        ckptio.save({"w": torch.ones(N)}, url, config)
    assert not os.path.exists(url) and not os.path.exists(tmp_path / "tier")


def test_a_damaged_node_copy_of_the_metadata_is_not_an_error_when_the_durable_tier_holds_it(tmp_path):
    """Finding 6: a truncated node-local ckptio.json, or one with a CRC character changed, while S3 holds
    the intact checkpoint: the load reads the durable document, and the node's data where it proves to be
    that checkpoint's."""
    run, tier = str(tmp_path / "run"), tmp_path / "tier"
    ckptio.save({"w": torch.arange(float(N))}, f"{run}/step-1", _tiered(tier))
    ckptio.wait_for_uploads()
    (node_doc,) = [os.path.join(top, "ckptio.json") for top, _, names in os.walk(tier) if "ckptio.json" in names]
    with open(node_doc, "rb") as f:
        raw = f.read()
    for damaged in (raw[: len(raw) // 2], raw.replace(b'"crc32c":"I', b'"crc32c":"H', 1)):
        with open(node_doc, "wb") as f:
            f.write(damaged)
        state = {"w": torch.zeros(N)}
        reader = ckptio.Reader(f"{run}/step-1", local_tier=str(tier))
        dcp.load(state, storage_reader=reader)
        assert torch.equal(state["w"], torch.arange(float(N)))
        assert reader.bytes_read["local"] > 0  # the node's data file is the committed checkpoint's
