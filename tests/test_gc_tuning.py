"""The router's garbage collector setting: what start-up allocated is frozen, the young
generation's threshold raised; None leaves the collector alone; `tuned` restores it."""

from __future__ import annotations

import gc

import pytest

from cluster.config import ClusterConfig
from router import gc_tuning


@pytest.fixture
def restore_gc():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)
    gc.unfreeze()


def test_tune_freezes_the_heap_and_raises_the_young_threshold(restore_gc):
    _, gen1, gen2 = gc.get_threshold()
    gc.unfreeze()
    assert gc_tuning.tune(4000) == (4000, gen1, gen2) == gc.get_threshold()
    assert gc.get_freeze_count() > 1000  # the modules, the test session


def test_none_leaves_the_collector_as_it_is(restore_gc):
    before = gc.get_threshold()
    gc.unfreeze()
    assert gc_tuning.tune(None) == before
    assert gc.get_freeze_count() == 0


def test_tuned_restores_thresholds_and_scans_the_frozen_objects_again():
    before = gc.get_threshold()
    with gc_tuning.tuned(3000) as inside:
        assert inside[0] == 3000 and gc.get_freeze_count() > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_the_router_setting_defaults_on_and_can_be_turned_off():
    assert ClusterConfig().router.gc_gen0_threshold == 5000
    off = ClusterConfig.model_validate({"router": {"gc_gen0_threshold": None}})
    assert off.router.gc_gen0_threshold is None
    with pytest.raises(ValueError):
        ClusterConfig.model_validate({"router": {"gc_gen0_threshold": 10}})
