"""The local POSIX store (``ckptio.storage.local``)."""

from __future__ import annotations

import os

import torch

import ckptio
from ckptio.tools.cli import main as cli_main
from tests.helpers.documents import load_error, saved_with_dcp


def test_a_fifo_in_place_of_a_data_file_is_refused_by_name(tmp_path):
    url = saved_with_dcp(tmp_path)
    (name,) = [n for n in os.listdir(url) if n.endswith(".ckio")]
    os.unlink(os.path.join(url, name))
    os.mkfifo(os.path.join(url, name))
    error = load_error(url, {"w": torch.zeros(70000), "blob": None, "cfg": {"lr": 0.0}})
    assert isinstance(error, ckptio.StorageError) and "not a regular file" in str(error) and name in str(error)
    assert cli_main(["verify", "-q", url]) == 1


def test_a_data_file_starts_its_writeback_every_few_mib_and_keeps_every_byte(tmp_path, monkeypatch):
    """The sink hints the kernel to write each WRITEBACK_BYTES as they come (the ranges, disjoint and in
    order, cover all but the tail), so the final fsync waits for the tail; the file holds every byte."""
    import sys

    from ckptio.config import WRITEBACK_BYTES
    from ckptio.storage import local, open_store

    started = []
    real = local.start_writeback
    monkeypatch.setattr(local, "start_writeback", lambda fd, at, n: (started.append((at, n)), real(fd, at, n)))
    data = os.urandom(3 << 20)
    sink = open_store(str(tmp_path)).open_sink("f")
    for _ in range(7):  # 21 MiB in 3 MiB writes
        sink.write(data)
    sink.close()
    assert open(tmp_path / "f", "rb").read() == data * 7
    step = -(-WRITEBACK_BYTES // len(data)) * len(data)  # a hint after the write that crosses the next 8 MiB
    assert started == [(at, step) for at in range(0, 7 * len(data) - step + 1, step)]
    if sys.platform.startswith("linux"):
        from ckptio.storage import writeback

        assert writeback.available()  # the hint is really given on Linux


def test_start_writeback_is_a_hint_that_never_fails(tmp_path):
    from ckptio.storage.writeback import start_writeback

    read_end, write_end = os.pipe()  # sync_file_range refuses a pipe (ESPIPE): nothing is raised
    try:
        start_writeback(write_end, 0, 1 << 20)
    finally:
        os.close(read_end)
        os.close(write_end)
    with open(tmp_path / "f", "wb") as f:
        f.write(b"x" * 4096)
        f.flush()
        start_writeback(f.fileno(), 0, 4096)
        start_writeback(f.fileno(), 1 << 40, 4096)  # past the end: nothing to write back


def test_reads_fill_every_request_whatever_the_threads_allowed(tmp_path):
    """Requests spanning several of the store's read tasks (READ_TASK_BYTES each) are all filled, on one
    thread (max_concurrency=1, read in the caller) as on several."""
    from ckptio.storage import ReadRequest, open_store
    from ckptio.storage.local import READ_TASK_BYTES

    data = os.urandom(3 * READ_TASK_BYTES + 12345)
    (tmp_path / "f").write_bytes(data)
    spans = [(at, min(at + READ_TASK_BYTES // 3, len(data))) for at in range(0, len(data), READ_TASK_BYTES // 3)]
    spans.append((len(data) - 10, len(data) + 90))  # short at the end of the file
    for threads in (1, 2, 8):
        store = open_store(str(tmp_path), config=ckptio.StorageConfig(max_concurrency=threads))
        buffers = [memoryview(bytearray(stop - start)) for start, stop in spans]
        counts = store.read_into([ReadRequest("f", start, (b,)) for (start, _), b in zip(spans, buffers, strict=True)])
        assert counts == [len(data[start:stop]) for start, stop in spans]
        assert all(
            bytes(b[:n]) == data[start : start + n] for (start, _), b, n in zip(spans, buffers, counts, strict=True)
        )
