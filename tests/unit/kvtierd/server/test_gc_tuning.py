"""The daemon's garbage-collector setting while it serves (kvtierd.server.gc_tuning)."""

import gc

import pytest

from kvtierd.server.gc_tuning import THRESHOLDS, rare_collections


def test_rare_collections_while_serving_and_the_previous_setting_after():
    before = gc.get_threshold()
    assert before != THRESHOLDS
    with rare_collections():
        assert gc.get_threshold() == THRESHOLDS
        assert gc.get_freeze_count() > 0  # start-up's objects are out of the collections
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_the_previous_setting_comes_back_when_serving_fails():
    before = gc.get_threshold()
    with pytest.raises(RuntimeError):
        with rare_collections():
            raise RuntimeError("the loop died")
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
