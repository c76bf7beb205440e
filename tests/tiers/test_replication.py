"""The fast tier copied to partner nodes (``local_tier_copies``): four gloo ranks on two simulated nodes
of two ranks, each node with its own fast-tier folder (``tiered.node_tier``), the durable tier on moto S3.
A lost node's ranks restart from the copies other nodes hold, fetched over the process group; a damaged,
missing or refused copy is read from another source; a full partner keeps fewer copies."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptio.format.codec import checksum
from ckptio.loading.shared_reads import Placements
from ckptio.storage import ReadRequest
from ckptio.tiers.nodes import NodeMap, this_node
from ckptio.tiers.peers import ALONE_BYTES, FETCH_PIECE_BYTES, FetchedFile, _Stream, fetch_pieces
from ckptio.tiers.replication import Pieces, fixed_pieces
from ckptio.tools.cli import main as cli_main
from tests.conftest import s3_objects
from tests.helpers import replicated, tiered
from tests.helpers.harness import run_ranks, spawn


def _node_files(tier_base: str, node: int, step: str) -> list[str]:
    root = os.path.join(tier_base, f"node{node}")
    (run,) = os.listdir(root)
    return sorted(os.listdir(os.path.join(root, run, step)))


def _ranks_held(names: list[str]) -> list[int]:
    """The ranks whose data file and index a node's folder holds."""
    return sorted(int(n[-10:-5]) for n in names if n.endswith(".ckio") and n + ".held.json" in names)


@pytest.mark.parametrize("copies", [2, 3])
@pytest.mark.parametrize("layout", [[2] * 8, [3, 1, 2, 2, 4], [1, 1], [2, 2, 2]])
def test_the_partner_rule_keeps_a_copy_through_the_loss_of_any_copies_minus_one_nodes(layout, copies):
    node_of_rank = [f"n{node}" for node, count in enumerate(layout) for _ in range(count)]
    nodes = NodeMap(node_of_rank)
    kept = min(copies, len(layout))
    holders = {
        r: {nodes.node_index[r], *(nodes.node_index[p] for p in nodes.partners(r, copies))} for r in nodes.node_index
    }
    assert all(len(on) == kept for on in holders.values())  # every copy on its own node
    for lost in itertools.combinations(range(len(layout)), kept - 1):
        assert all(on - set(lost) for on in holders.values()), lost
    for rank in nodes.node_index:  # sources and partners are the two ends of the same rule
        assert nodes.sources(rank, copies) == [r for r in nodes.node_index if rank in nodes.partners(r, copies)]
    if len(set(layout)) == 1:  # even nodes: each rank sends and receives copies-1 files' worth
        assert all(len(nodes.sources(r, copies)) == kept - 1 for r in nodes.node_index)


_FILES = {"a": bytes(range(256)) * 3, "b": bytes(reversed(range(256))) * 2}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "gone"]), st.integers(0, 700), st.integers(0, 300)).filter(
            lambda s: s[0] == "gone" or s[1] + s[2] <= len(_FILES[s[0]])
        ),
        max_size=8,
    ),
    st.integers(1, 400),
    st.booleans(),
)
def test_a_stream_of_byte_ranges_travels_in_pieces_that_hold_exactly_those_bytes(
    tmp_path_factory, segments, piece_bytes, checked
):
    folder = tmp_path_factory.mktemp("pieces")
    for name, data in _FILES.items():
        (folder / name).write_bytes(data)
    sizes = fixed_pieces([length for _, _, length in segments], piece_bytes)
    stream = Pieces(str(folder), segments, checked, sizes)
    pieces = list(iter(stream.next, None))
    assert [len(p) for p, _ in pieces] == sizes
    assert sizes[:-1] == [piece_bytes] * (len(sizes) - 1)
    sent = b"".join(bytes(p.numpy()) for p, _ in pieces)
    meant = (_FILES.get(name, bytes(offset + length))[offset : offset + length] for name, offset, length in segments)
    assert sent == b"".join(meant)
    at = 0
    for piece, crc in pieces:  # a piece holding bytes of a file that cannot be read fails its check
        unread = any(n == "gone" and o < at + len(piece) and at < o + length for n, o, length in _placed(segments))
        assert (crc == checksum(memoryview(piece.numpy()))) == (checked and not unread)
        at += len(piece)


@given(st.lists(st.integers(1, 3 * FETCH_PIECE_BYTES), max_size=12))
def test_a_fetch_sends_each_large_item_in_messages_of_its_own_and_the_small_ones_together(lengths):
    pieces = fetch_pieces(lengths)
    assert sum(pieces) == sum(lengths) and all(0 < p <= FETCH_PIECE_BYTES for p in pieces)
    bounds = set(itertools.accumulate(pieces, initial=0))
    starts = list(itertools.accumulate(lengths, initial=0))
    for length, start in zip(lengths, starts, strict=False):
        if length >= ALONE_BYTES:  # its own messages: they start and end with it
            assert start in bounds and start + length in bounds
        else:  # never split
            assert not any(start < b < start + length for b in bounds)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 100, ALONE_BYTES - 1, ALONE_BYTES, 3 << 20]), st.booleans()), max_size=6))
def test_a_fetched_stream_lands_each_item_in_its_place_or_a_buffer_and_reads_back_exact(items):
    segments, places, at = [], {}, 0
    for length, placed in items:
        segments.append(("f", at, length))
        if placed:
            places[at] = memoryview(torch.zeros(length, dtype=torch.uint8).numpy())
        at += length + 7  # items apart in the file
    data = torch.randint(0, 256, (at,), dtype=torch.uint8)
    stream = _Stream(segments, Placements([("f", start, dest) for start, dest in places.items()]))
    sent = b"".join(bytes(data[o : o + n].numpy()) for _, o, n in segments)
    assert [len(memory) for memory in stream.messages] == fetch_pieces([n for _, _, n in segments])
    k = 0
    for memory in stream.messages:  # what each posted receive fills
        memory[:] = torch.frombuffer(bytearray(sent[k : k + len(memory)]), dtype=torch.uint8)
        k += len(memory)
    arrived = stream.whole()
    assert [(o, len(memory)) for _, o, memory in arrived] == [(o, n) for _, o, n in segments]
    fetched = FetchedFile(at, [(o, memory) for _, o, memory in arrived])
    for _, o, memory in arrived:
        n = len(memory)
        if o in places and n >= ALONE_BYTES:  # received into its place: read back without a copy
            assert memory.data_ptr() == torch.frombuffer(places[o], dtype=torch.uint8).data_ptr()
        out = places.get(o, memoryview(bytearray(n)))
        fetched.read_into(ReadRequest("f", o, (out,)))
        assert bytes(out) == bytes(data[o : o + n].numpy())


def _placed(segments):
    """Each segment with its start in the stream (in place of its file offset)."""
    at = 0
    for name, _, length in segments:
        if length:
            yield name, at, length
        at += length


@pytest.mark.parametrize(
    "mode, codec, collectives",
    [("all_ranks", "raw", True), ("replica_group", "zstd", True), ("all_ranks", "zstd", False)],
)
def test_a_node_lost_before_its_drain_finished_restarts_from_its_partner_with_nothing_from_s3(
    s3, tmp_path, mode, codec, collectives, capsys
):
    base, options = s3
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    config = {"mode": mode, "compression": None if codec == "raw" else "zstd", "local_tier_copies": 2}
    if not collectives:
        config["tuning"] = {
            "inline_limit": 0
        }  # a fragment keeps small items inline by default: every item in the files
    saved = spawn(4, replicated.save_cut_off_and_count, run, tiers, (1, 4), options, config, collectives)
    assert all("cannot finish within drain_timeout_s" in raised for raised, _, _ in saved)  # every rank's cut off
    for rank, (_, sent, own) in enumerate(saved):  # (k-1) x each rank's files, nothing more
        assert sent["file"] == sum(own.values()), (rank, sent, own)
    for node in (0, 1):  # every rank's files and what commits them on a node: ckptio.json, or each fragment
        names = _node_files(tiers, node, "step-2")
        committing = ["ckptio.json"] if collectives else [f"ckptio.rank-{r:05d}-of-00004.json" for r in range(4)]
        assert _ranks_held(names) == [0, 1, 2, 3] and set(committing) <= set(names), names
    assert "ckptio.json" not in [k.rsplit("/", 1)[1] for k in s3_objects(options, f"{run}/step-2/")]
    if collectives:
        _inspect_and_gc_show_the_partners_copies(run, os.path.join(tiers, "node0"), options, capsys)

    shutil.rmtree(os.path.join(tiers, "node1"))  # node 1 lost; its replacement's fast tier is empty
    restarted = spawn(4, tiered.restart, run, tiers, (1, 4), options)
    assert [r[:2] for r in restarted] == [(f"{run}/step-2", [])] * 4
    read = [r[2] for r in restarted]
    assert [r["durable"] for r in read] == [0, 0, 0, 0]
    assert [r["local"] > 0 for r in read] == [True, True, False, False] and all(r["peer"] > 0 for r in read[2:])
    assert "ckptio.json" in [k.rsplit("/", 1)[1] for k in s3_objects(options, f"{run}/step-2/")]  # drained behind
    assert not os.path.exists(os.path.join(tiers, "node1"))  # fetched for the load, in memory: nothing written
    again = spawn(4, tiered.restart, run, tiers, (1, 4), options)  # committed on S3 now: still from the nodes
    assert [r[:2] for r in again] == [(f"{run}/step-2", [])] * 4
    assert [(r[2]["durable"], r[2]["peer"] > 0) for r in again] == [(0, False)] * 2 + [(0, True)] * 2


def _inspect_and_gc_show_the_partners_copies(run: str, tier: str, options: dict, capsys) -> None:
    """Node 0 holds step 1 (drained) and step 2 (not): inspect lists every rank's file there, and gc removes
    step 1 with the partners' copies in it."""
    opts = ["--storage-options", json.dumps(options)]
    assert cli_main(["inspect", f"{run}/step-2", "--local-tier", tier, "--json", *opts]) == 0
    node = json.loads(capsys.readouterr().out)["tiers"]["node"]
    assert sorted(f["rank"] for f in node["files"]) == [0, 1, 2, 3] and node["committed_here"]
    assert cli_main(["gc", run, "--local-tier", tier, "--keep", "1", "--delete", *opts]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step-")]
    assert "removable  ranks 0,1,2,3;" in lines[0] and "kept       ranks 0,1,2,3;" in lines[1], lines
    assert sorted(os.listdir(os.path.join(tier, os.listdir(tier)[0]))) == ["step-2"]


def test_a_node_lost_then_a_restart_on_another_mesh_reads_its_items_from_the_other_node(s3, tmp_path):
    base, options = s3
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    config = {"mode": "replica_group", "local_tier_copies": 2}
    launcher = {"LOCAL_WORLD_SIZE": "2"}  # the nodes as a launcher tells them (ranks numbered node by node)
    spawn(4, tiered.save_with_a_stalled_drain, run, tiers, (2, 2), options, True, config, env=launcher)
    assert _ranks_held(_node_files(tiers, 1, "step-2")) == [0, 1, 2, 3]
    shutil.rmtree(os.path.join(tiers, "node1"))
    restarted = spawn(4, tiered.restart, run, tiers, (1, 4), options, env=launcher)  # resharded: a quarter each
    assert [r[:2] for r in restarted] == [(f"{run}/step-2", [])] * 4
    assert [(r[2]["durable"], r[2]["local"] > 0, r[2]["peer"] > 0) for r in restarted] == (
        [(0, True, False)] * 2 + [(0, False, True)] * 2
    )


def test_a_node_is_named_by_ckptio_node_then_by_the_launcher_then_by_the_host(monkeypatch):
    monkeypatch.setenv("CKPTIO_NODE", "rack1-n3")
    monkeypatch.setenv("GROUP_RANK", "2")
    assert this_node() == "rack1-n3"
    monkeypatch.delenv("CKPTIO_NODE")
    assert this_node() == "node-2"
    monkeypatch.delenv("GROUP_RANK")
    assert this_node() == socket.gethostname()


def test_without_copies_a_lost_node_reads_its_shards_from_s3(s3, tmp_path):
    base, options = s3
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    spawn(4, tiered.save_steps, run, tiers, (1, 4), [1], options, {"mode": "all_ranks"})
    shutil.rmtree(os.path.join(tiers, "node1"))
    restarted = spawn(4, tiered.restart, run, tiers, (1, 4), options)
    assert [r[:2] for r in restarted] == [(f"{run}/step-1", [])] * 4
    read = [r[2] for r in restarted]
    assert [r["durable"] > 0 for r in read] == [False, False, True, True]


def test_a_damaged_or_missing_partner_copy_is_read_from_s3(s3, tmp_path):
    base, options = s3
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    spawn(4, tiered.save_steps, run, tiers, (1, 4), [1], options, {"mode": "all_ranks", "local_tier_copies": 2})
    folder = os.path.join(tiers, "node0", os.listdir(os.path.join(tiers, "node0"))[0], "step-1")
    (of_rank2,) = [n for n in os.listdir(folder) if n.endswith("-r00002.ckio")]
    (of_rank3,) = [n for n in os.listdir(folder) if n.endswith("-r00003.ckio")]
    tiered.flip_a_byte(os.path.join(folder, of_rank2))
    os.remove(os.path.join(folder, of_rank3))
    shutil.rmtree(os.path.join(tiers, "node1"))
    restarted = spawn(4, tiered.restart, run, tiers, (1, 4), options)
    assert [r[:2] for r in restarted] == [(f"{run}/step-1", [])] * 4
    assert [r[2]["durable"] > 0 for r in restarted] == [False, False, True, True], [r[2] for r in restarted]
    assert not os.path.exists(
        os.path.join(tiers, "node1", os.listdir(os.path.join(tiers, "node0"))[0], "step-1", of_rank2)
    )


def test_a_full_partner_keeps_fewer_copies_with_one_warning_a_save_and_latest_knows(s3, tmp_path):
    base, options = s3
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    warnings = spawn(4, replicated.save_with_a_full_partner, run, tiers, options, {"local_tier_copies": 2})
    refused = [sum("cannot keep a partner's" in w for w in ws) for ws in warnings]
    assert refused == [0, 0, 2, 2], warnings  # one a save
    assert _ranks_held(_node_files(tiers, 1, "step-2")) == [2, 3]  # node 0's copies did not fit
    assert _ranks_held(_node_files(tiers, 0, "step-2")) == [0, 1, 2, 3]
    shutil.rmtree(os.path.join(tiers, "node0"))  # step 2's files of node 0 are nowhere else: step 1 it is
    restarted = spawn(4, replicated.restart_big, run, tiers, options)
    assert [r[:2] for r in restarted] == [(f"{run}/step-1", [])] * 4


@pytest.mark.slow
def test_a_node_killed_as_its_copies_and_drain_start_restarts_from_a_step_that_loads(s3, tmp_path):
    base, options = s3
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    config = {"mode": "all_ranks", "local_tier_copies": 2, "tuning": {"drain_timeout_s": 3}}
    outcomes = run_ranks(4, replicated.save_then_lose_node1, run, tiers, (1, 4), options, config, timeout=120)
    assert [status for status, _ in outcomes] == ["ok", "ok", "died", "died"], outcomes
    shutil.rmtree(os.path.join(tiers, "node1"))
    restarted = spawn(4, tiered.restart, run, tiers, (1, 4), options)
    (url,) = {r[0] for r in restarted}
    assert url in (f"{run}/step-1", f"{run}/step-2") and [r[1] for r in restarted] == [[]] * 4


@pytest.mark.parametrize("window", [1, 256 << 20])
def test_a_fetch_moves_every_stream_at_once_both_ways_and_lands_each_item_exact(tmp_path, window):
    """Three ranks each serving the two others and receiving from both at once (every receive posted
    before any send); with a window of one byte every send is awaited as soon as it is posted."""
    lengths = [5, ALONE_BYTES, 100, FETCH_PIECE_BYTES + 11, 7, ALONE_BYTES - 1]
    assert spawn(3, replicated.fetch_streams, str(tmp_path), lengths, window) == [[]] * 3
