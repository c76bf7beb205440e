"""``ckptio.gc_pause``: the collector paused around metadata work, restored as it was."""

from __future__ import annotations

import pytest


def test_paused_gc_restores_the_collector_as_it_was():
    import gc

    from ckptio.gc_pause import paused_gc

    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        assert not gc.isenabled()
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # the caller's choice stands
    finally:
        gc.enable()
