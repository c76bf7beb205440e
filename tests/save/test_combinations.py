"""Every feature with every other (``helpers/combinations.py``): a covering array of the settings a save
combines (mode, compression, dcp.save / dcp.async_save, a node tier with or without copies on the other
node, incremental against "previous" or a named step, with or without collectives, key prefixes, a local
folder or S3, the default process group or each replica group over its own), each row saved twice on 4
gloo ranks and its second step loaded exact on the same mesh, resharded on 2 ranks and in one process, and
verified block by block."""

from __future__ import annotations

import itertools
import os

import pytest

from ckptio.loading.reader import read_manifest
from ckptio.storage import open_store
from ckptio.tools.verify import verify
from tests.helpers import combinations
from tests.helpers.harness import spawn

ROWS = combinations.covering_rows()


def test_the_rows_cover_every_pair_of_settings_and_the_eight_of_tiers_incremental_and_collectives():
    for a, b in itertools.combinations(combinations.AXES, 2):
        met = {(row[a], row[b]) for row in ROWS}
        assert met == set(itertools.product(combinations.AXES[a], combinations.AXES[b])), (a, b)
    eight = {(row["tier"] is not None, row["incremental"] is not None, row["collectives"]) for row in ROWS}
    assert len(eight) == 8


@pytest.mark.slow
def test_every_row_saves_twice_and_its_second_step_loads_exact_on_any_mesh(s3, tmp_path):
    base, storage_options = s3
    options = {"base": base, "storage_options": storage_options}
    root = str(tmp_path)
    saved = spawn(4, combinations.save_and_load_rows, root, ROWS, options, timeout=600)
    assert saved == [[[]] * len(ROWS)] * 4, list(zip(ROWS, zip(*saved, strict=True), strict=True))
    resharded = spawn(2, combinations.load_rows, root, ROWS, options, (2,))
    assert resharded == [[[]] * len(ROWS)] * 2, list(zip(ROWS, zip(*resharded, strict=True), strict=True))
    assert combinations.load_rows(root, ROWS, options, None) == [[]] * len(ROWS)
    for index, row in enumerate(ROWS):
        store = open_store(combinations.url_of(root, row, index, 2, options), storage_options)
        manifest = read_manifest(store)
        assert verify(store, manifest) == [], row
        chain = manifest.header.chain
        assert (chain and chain.base, chain and chain.referenced_bytes > 0) == (  # the frozen weights referenced
            ("step-1", True) if row["incremental"] else (None, None)
        ), row


@pytest.mark.skipif(
    not os.environ.get("CKPTIO_FULL_PRODUCT"), reason="the full product (768 rows, ~25 min): CKPTIO_FULL_PRODUCT=1"
)
def test_the_full_product_of_the_settings(s3, tmp_path):
    rows = combinations.all_rows()
    base, storage_options = s3
    options = {"base": base, "storage_options": storage_options}
    for start in range(0, len(rows), 64):  # a spawn per 64 rows: each within its timeout
        part = rows[start : start + 64]
        saved = spawn(4, combinations.save_and_load_rows, str(tmp_path / f"part{start}"), part, options, timeout=1800)
        assert saved == [[[]] * len(part)] * 4, list(zip(part, zip(*saved, strict=True), strict=True))
