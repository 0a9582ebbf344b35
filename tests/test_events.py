"""Loader events reach every observer: starts, batches, deaths, restarts, epoch ends."""

from __future__ import annotations

import numpy as np
import plugin_fixtures as fx
import pytest

import shmloader
from shmloader.events import Events
from shmloader.plugins import PluginError, build_plugin_manager


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_observer_sees_every_event_of_an_epoch_in_order(method):
    rec = fx.Recorder()
    loader = shmloader.DataLoader(np.arange(24.0).reshape(12, 2), batch_size=3, num_workers=2,
                                  multiprocessing_context=method, plugins=[rec])
    got = [b.copy() for b in loader]
    kinds = rec.kinds()
    assert kinds == ["started", "started"] + ["batch"] * 4 + ["epoch_end"]
    assert sorted(e["worker_id"] for k, e in rec.events if k == "started") == [0, 1]
    batches = [e for k, e in rec.events if k == "batch"]
    assert [e["task"] for e in batches] == [0, 1, 2, 3]
    assert all(e["nbytes"] == got[0].nbytes for e in batches)
    assert all(e["fetch_s"] >= 0 and e["collate_s"] > 0 and e["wait_s"] >= 0 for e in batches)
    end = rec.events[-1][1]
    assert end["epoch"] == 0 and end["stats"]["batches"] == 4


@pytest.mark.timeout(60)
def test_epoch_numbers_count_the_loaders_epochs():
    rec = fx.Recorder()
    loader = shmloader.DataLoader(np.zeros(8), batch_size=4, num_workers=1, plugins=[rec])
    for _ in range(3):
        list(loader)
    assert [e["epoch"] for k, e in rec.events if k == "epoch_end"] == [0, 1, 2]
    assert rec.events[-1][1]["stats"]["epochs"] == 3


@pytest.mark.timeout(60)
def test_observer_sees_a_worker_death_and_its_restart(tmp_path):
    rec = fx.Recorder()
    loader = shmloader.DataLoader(fx.DiesOnce(str(tmp_path / "died")), batch_size=2, num_workers=2,
                                  multiprocessing_context="fork", on_worker_death="restart", plugins=[rec])
    values = np.concatenate([b.copy() for b in loader]).tolist()
    assert values == list(range(16))  # every batch still delivered, once and in order
    died = [e for k, e in rec.events if k == "died"]
    restarted = [e for k, e in rec.events if k == "restarted"]
    assert len(died) == 1 and died[0]["exitcode"] == 3
    assert any(5 in indices for indices in died[0]["tasks"].values())
    assert restarted == [{"worker_id": died[0]["worker_id"], "pid": restarted[0]["pid"], "old_pid": died[0]["pid"]}]
    assert rec.kinds().index("died") < rec.kinds().index("restarted")
    assert rec.kinds()[-1] == "epoch_end" and rec.kinds().count("batch") == 8
    stats = loader.stats()
    assert (stats["worker_deaths"], stats["worker_restarts"], stats["worker_starts"]) == (1, 1, 3)


@pytest.mark.timeout(60)
def test_observer_sees_the_death_before_the_error():
    class Dies:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            import os

            os._exit(7)

    rec = fx.Recorder()
    loader = shmloader.DataLoader(Dies(), batch_size=2, num_workers=1, multiprocessing_context="fork",
                                  plugins=[rec])
    with pytest.raises(shmloader.WorkerDied):
        list(loader)
    assert "died" in rec.kinds() and next(e for k, e in rec.events if k == "died")["exitcode"] == 7


def test_events_without_a_loader_feed_the_stats_observer():
    events = Events()
    events.worker_started(0, 123)
    events.batch_ready(0, 0, 100, 0.01, 0.02, 0.5, ready=2, in_flight=1, slots=4)
    events.epoch_end()
    s = events.stats.summary()
    assert (s["worker_starts"], s["batches"], s["bytes"], s["epochs"]) == (1, 1, 100, 1)
    assert s["workers"][0] == {"batches": 1, "fetch_s": 0.01, "collate_s": 0.02, "bytes": 100}
    assert s["slots"]["max_ready"] == 2 and s["slots"]["max_slots"] == 4


def test_observer_taking_a_subset_of_arguments_is_called():
    seen = []

    class Bytes:
        def shmloader_batch_ready(self, nbytes):
            seen.append(nbytes)

    events = Events(build_plugin_manager([Bytes()], entry_points=False))
    events.batch_ready(3, 1, 64, 0.0, 0.0, 0.0)
    assert seen == [64]


@pytest.mark.parametrize("event, args", [
    ("worker_started", (0, 1)),
    ("worker_died", (0, 1, -9, {})),
    ("worker_restarted", (0, 2, 1)),
    ("epoch_end", ()),
])
def test_every_observer_hook_error_names_plugin_and_hook(event, args):
    hook = f"shmloader_{event}"

    class Faulty:
        pass

    def fail(self, **kwargs):
        raise OSError("disk full")

    setattr(Faulty, hook, fail)
    events = Events(build_plugin_manager([Faulty()], entry_points=False))
    with pytest.raises(PluginError, match=f"plugin 'Faulty' raised in {hook}: OSError: disk full") as info:
        getattr(events, event)(*args)
    assert info.value.hook == hook


def test_observer_registered_after_the_first_event_is_called():
    plugins = build_plugin_manager(entry_points=False)
    events = Events(plugins)
    events.batch_ready(0, 0, 1, 0.0, 0.0, 0.0)
    late = fx.Recorder()
    plugins.register(late)
    events.batch_ready(1, 0, 2, 0.0, 0.0, 0.0)
    assert [e["task"] for k, e in late.events if k == "batch"] == [1]
    assert events.stats.batches == 2


def test_wrapper_observers_run_through_pluggy_in_order():
    from shmloader.hookspecs import hookimpl

    order = []

    class Wrap:
        @hookimpl(wrapper=True)
        def shmloader_batch_ready(self, task):
            order.append(("before", task))
            yield
            order.append(("after", task))

    class Plain:
        def shmloader_batch_ready(self, task):
            order.append(("plain", task))

    events = Events(build_plugin_manager([Plain(), Wrap()], entry_points=False))
    events.batch_ready(7, 0, 1, 0.0, 0.0, 0.0)
    assert order == [("before", 7), ("plain", 7), ("after", 7)]
    assert events.stats.batches == 1


def test_hook_cost_is_measurable():
    from shmloader.events import hook_cost_ns

    cost = hook_cost_ns(observers=1, calls=200, repeats=2)
    assert 0 < cost < 1e6


class _FailsOnThird:
    def __init__(self) -> None:
        self.seen = 0

    def shmloader_batch_ready(self, task: int) -> None:
        self.seen += 1
        if self.seen == 3:
            raise OSError("disk full")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_an_observer_error_loses_no_batch(workers):
    import numpy as np

    import shmloader

    ds = shmloader.ArrayDataset(np.arange(20))
    kw = {"num_workers": workers, "multiprocessing_context": "fork"} if workers else {}
    dl = shmloader.DataLoader(ds, batch_size=2, plugins=[_FailsOnThird()], **kw)
    it = iter(dl)
    got = [int(next(it)[0][0]) for _ in range(3)]  # the third batch still arrives
    with pytest.raises(PluginError, match="disk full"):
        next(it)  # ... and the observer's error comes with the next call
    got += [int(b[0][0]) for b in it]
    assert got == list(range(0, 20, 2))  # nothing skipped, nothing repeated
