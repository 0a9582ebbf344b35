"""loader.stats(): real timings from the built-in stats observer, and the bottleneck verdict."""

from __future__ import annotations

import io

import numpy as np
import pytest

import shmloader
from shmloader.builtin import stats as stats_mod
from shmloader.builtin.stats import Stats


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.timeout(60)
def test_stats_report_real_timings_bytes_and_occupancy():
    data = np.arange(64.0 * 8).reshape(64, 8)
    loader = shmloader.DataLoader(data, batch_size=8, num_workers=2)
    nbytes = sum(b.nbytes for b in loader)
    s = loader.stats()
    assert loader._plugins.pm.get_plugin("shmloader.builtin.stats") is loader._events.stats
    assert (s["batches"], s["bytes"], s["epochs"], s["worker_starts"]) == (8, nbytes, 1, 2)
    assert sum(w["batches"] for w in s["workers"].values()) == 8
    assert sum(w["bytes"] for w in s["workers"].values()) == nbytes
    assert all(w["fetch_s"] > 0 and w["collate_s"] > 0 for w in s["workers"].values())
    assert s["wait_s"] > 0  # the first batch at least waited for the workers to start
    assert s["slots"]["max_slots"] >= 1 and 0 <= s["slots"]["mean_ready"] <= s["slots"]["max_slots"]
    assert s["bottleneck"].split(":")[0] in ("data loading is the bottleneck", "the consumer is the bottleneck")


def test_stats_before_any_batch_say_so():
    loader = shmloader.DataLoader(np.zeros(4))
    assert loader.stats()["bottleneck"] == "no batches yet: nothing measured"


@pytest.mark.parametrize("wait_s, consumer_s, verdict", [
    # 11 waits (the first batch's included) against 10 measured consumer intervals
    (0.9, 0.1, "data loading is the bottleneck: the consumer spent 91% of its time waiting"),
    (0.01, 0.99, "the consumer is the bottleneck: it waited for batches only 1% of its time"),
])
def test_verdict_weighs_waiting_against_consuming(monkeypatch, wait_s, consumer_s, verdict):
    clock = FakeClock()
    monkeypatch.setattr(stats_mod, "time", clock)
    s = Stats()
    for _ in range(11):  # each interval between hand-outs: consumer_s working, wait_s waiting
        s.shmloader_batch_ready(task=0, worker_id=0, nbytes=10, fetch_s=0.0, collate_s=0.0, wait_s=wait_s,
                                ready=0, in_flight=0, slots=2)
        clock.now += consumer_s + wait_s
    assert s.consumer_s == pytest.approx(10 * consumer_s)
    assert s.summary()["bottleneck"].startswith(verdict)


def test_time_between_epochs_is_not_counted(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(stats_mod, "time", clock)
    s = Stats()
    s.shmloader_batch_ready(task=0, worker_id=0, nbytes=1, fetch_s=0, collate_s=0, wait_s=0, ready=0, in_flight=0, slots=1)
    s.shmloader_epoch_end()
    clock.now += 1000.0
    s.shmloader_batch_ready(task=0, worker_id=0, nbytes=1, fetch_s=0, collate_s=0, wait_s=0, ready=0, in_flight=0, slots=1)
    assert s.consumer_s == 0.0


@pytest.mark.timeout(60)
def test_progress_observer_shows_batches_and_throughput_per_epoch():
    pytest.importorskip("tqdm")
    from shmloader.builtin.progress import Progress

    out = io.StringIO()
    loader = shmloader.DataLoader(np.zeros((40, 4)), batch_size=5, num_workers=1,
                                  plugins=[Progress(total=8, file=out, mininterval=0)])
    for _ in range(2):
        list(loader)
    text = out.getvalue()
    assert "epoch 0" in text and "epoch 1" in text
    assert "8/8" in text and "MB/s" in text
    assert loader._plugins.pm.get_plugin("Progress").bar is None  # closed at epoch end
