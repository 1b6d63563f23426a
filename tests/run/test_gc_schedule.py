"""training.gc_interval: Python's automatic garbage collection is off during the training loop and the young
generations are collected at fixed steps (atma_titan/gc_schedule.py); the collector is back on afterwards."""

from __future__ import annotations

import gc

import pytest
from helpers import SMALL

import atma_titan.run.gc_schedule as gc_schedule
from atma_titan.config import ConfigError, load_config
from atma_titan.run.gc_schedule import GCSchedule
from atma_titan.train import train


@pytest.fixture
def collections(monkeypatch):
    calls = []
    monkeypatch.setattr(gc_schedule.gc, "collect", lambda generation=2: calls.append(generation))
    return calls


def test_collection_is_off_inside_and_runs_every_interval_steps(collections):
    assert gc.isenabled()
    with GCSchedule(3) as schedule:
        assert not gc.isenabled()
        for step in range(1, 8):
            schedule.step(step)
    assert gc.isenabled()
    assert collections == [1, 1, 1]  # on entering, then at steps 3 and 6


def test_interval_0_leaves_the_automatic_collector_alone(collections):
    with GCSchedule(0) as schedule:
        assert gc.isenabled()
        schedule.step(50)
    assert gc.isenabled() and collections == []


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with GCSchedule(5):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_trainer_collects_at_the_interval_with_the_collector_off(tmp_path, monkeypatch):
    seen = []
    step = GCSchedule.step
    monkeypatch.setattr(GCSchedule, "step", lambda self, s: seen.append((s, gc.isenabled())) or step(self, s))
    cfg = SMALL + ["--training.steps", "4", "--training.gc_interval", "2", "--metrics.stdout", "false"]
    train(load_config(cfg + ["--job.dump_folder", str(tmp_path)]))
    assert seen == [(1, False), (2, False), (3, False), (4, False)]
    assert gc.isenabled()


def test_a_negative_interval_is_refused():
    with pytest.raises(ConfigError, match="training.gc_interval"):
        load_config(["--training.gc_interval", "-1"])
