"""The data path and the plain DCP calls on every object store (``STORES``: moto, radosgw, fake-gcs-server,
Azurite): both save modes, with and without compression, saved on a 2x2 mesh in parts and loaded
resharded; ``dcp.save``, ``dcp.async_save``, ``ckptio.latest`` and the create-only commit through one
process. What each store's requests look like is in ``test_s3.py`` and the store modules' own tests."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptio
from ckptio.storage import open_store
from ckptio.storage.object_store import PROBE_PREFIX
from tests.conftest import STORES, store_objects
from tests.helpers import scenarios
from tests.helpers.harness import spawn

SIZE = 32 << 20
PART = 5 << 20


@pytest.mark.slow
@pytest.mark.parametrize("store", STORES, indirect=True)
@pytest.mark.parametrize("mode,compression", [("all_ranks", None), ("replica_group", "zstd")])
def test_both_modes_save_in_parts_and_load_resharded_bit_exact(store, mode, compression):
    base, options = store
    url = f"{base}/run/ckpt"
    save = partial(scenarios.bench_save, storage_config={"part_size": PART}, compression=compression)
    spawn(4, save, url, SIZE, (2, 2), mode, options)
    for mesh in [(1, 4), (4, 1)]:  # each rank needs a part of several saved pieces
        results = spawn(4, scenarios.bench_load, url, SIZE, mesh, options)
        assert all(bad == [] for bad, _ in results), results
    objects = store_objects(url, options)
    assert not [name for name in objects if ".ckptio-part." in name or name.startswith(PROBE_PREFIX)], objects


@pytest.mark.parametrize("store", STORES, indirect=True)
def test_plain_and_async_dcp_saves_latest_and_the_create_only_commit(store):
    base, options = store
    run = f"{base}/run"
    state = {"w": torch.arange(1000.0), "step": 1}
    dcp.save(state, storage_writer=ckptio.Writer(f"{run}/step-1", storage_options=options))
    state = {"w": torch.arange(1000.0) * 2, "step": 2}
    dcp.async_save(state, storage_writer=ckptio.Writer(f"{run}/step-2", storage_options=options)).result()

    newest = ckptio.latest(run, storage_options=options)
    assert newest == f"{run}/step-2"
    out = {"w": torch.zeros(1000), "step": 0}
    dcp.load(out, storage_reader=ckptio.Reader(newest, storage_options=options))
    assert torch.equal(out["w"], state["w"]) and out["step"] == 2

    with pytest.raises(CheckpointException) as refused:  # a committed checkpoint is not overwritten
        dcp.save(state, storage_writer=ckptio.Writer(f"{run}/step-1", storage_options=options))
    assert isinstance(ckptio.unwrap(refused.value), ckptio.CheckpointExistsError), refused.value
    dcp.load(out, storage_reader=ckptio.Reader(f"{run}/step-1", storage_options=options))
    assert torch.equal(out["w"], torch.arange(1000.0)) and out["step"] == 1


@pytest.mark.parametrize("store", STORES, indirect=True)
def test_listings_see_what_was_written_since_the_last_listing(store):
    """A listing is asked afresh, never answered from the filesystem's cache: a merge waiting for the
    other ranks' fragments polls it (adlfs kept its first answer, and the merge waited out its 600 s)."""
    base, options = store
    ckptio_store = open_store(f"{base}/run/step-1", options)
    ckptio_store.put_atomic("a.json", b"{}")
    assert ckptio_store.list_names() == ["a.json"]
    assert sorted(ckptio_store.list_sizes()) == ["a.json"]
    ckptio_store.put_atomic("b.json", b"{}")
    assert ckptio_store.list_names() == ["a.json", "b.json"]
    assert sorted(ckptio_store.list_sizes()) == ["a.json", "b.json"]
    assert open_store(f"{base}/run", options).list_names() == ["step-1"]
    ckptio_store.remove("a.json")
    assert ckptio_store.list_names() == ["b.json"]
    assert sorted(ckptio_store.list_sizes()) == ["b.json"]


@pytest.mark.parametrize("store", STORES, indirect=True)
def test_a_save_at_a_buckets_root_is_refused_by_name_with_nothing_written(store):
    base, options = store
    for save in (
        lambda: ckptio.save({"w": torch.ones(4)}, base, storage_options=options),
        lambda: dcp.save({"w": torch.ones(4)}, storage_writer=ckptio.Writer(base, storage_options=options)),
    ):
        with pytest.raises((ckptio.StorageError, CheckpointException)) as refused:
            save()
        message = str(ckptio.unwrap(refused.value))
        assert f"{base}: a checkpoint needs a folder inside the" in message and "Nothing was saved" in message
        assert store_objects(base, options) == {}
