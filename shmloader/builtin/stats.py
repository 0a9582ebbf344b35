"""The built-in stats observer: the counters and timings behind ``loader.stats()``.

Owns one loader's counters across its epochs: per-worker fetch and collate time, bytes moved,
the consumer's wait time, slot occupancy and worker lifecycle counts. Runs in the main process,
registered by the plugin factory exactly like a third-party observer. Promises: its
``shmloader_batch_ready`` does a handful of additions (it is on the hot path, once per batch), and
``summary()`` says in one line whether data loading or the consumer is the bottleneck.

How the verdict is reached: between two batches handed out, the consumer either worked on the
previous batch (``consumer_s``) or waited in ``next()`` for the next one (``wait_s``). A consumer
that spends more than ``LOADING_BOUND_SHARE`` of that time waiting is starved by the loader.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from shmloader.hookspecs import hookimpl

LOADING_BOUND_SHARE = 0.10
"""Wait share above which data loading, not the consumer, is called the bottleneck."""


@dataclass(slots=True)
class WorkerStats:
    """Totals of one worker id (across restarts)."""

    batches: int = 0
    fetch_s: float = 0.0
    collate_s: float = 0.0
    bytes: int = 0


@dataclass(slots=True)
class Occupancy:
    """Slot occupancy sampled at each batch handed out: sums (for means) and peaks."""

    ready_sum: int = 0
    in_flight_sum: int = 0
    max_ready: int = 0
    max_slots: int = 0


@dataclass(eq=False)
class Stats:
    """Counters of one loader, across its epochs; an observer plugin (see module docstring)."""

    wait_s: float = 0.0
    consumer_s: float = 0.0
    epochs: int = 0
    worker_starts: int = 0
    worker_deaths: int = 0
    worker_restarts: int = 0
    workers: dict[int, WorkerStats] = field(default_factory=dict)
    occupancy: Occupancy = field(default_factory=Occupancy)
    _last_handout: float | None = field(default=None, repr=False)

    # -- observer hooks ---------------------------------------------------------------------
    @hookimpl
    def shmloader_worker_started(self) -> None:
        self.worker_starts += 1

    @hookimpl
    def shmloader_worker_died(self) -> None:
        self.worker_deaths += 1

    @hookimpl
    def shmloader_worker_restarted(self) -> None:
        self.worker_restarts += 1
        self.worker_starts += 1

    @hookimpl
    def shmloader_batch_ready(self, task: int, worker_id: int, nbytes: int, fetch_s: float, collate_s: float,
                              wait_s: float, ready: int, in_flight: int, slots: int) -> None:
        # takes every argument, in the spec's order, so Events calls it positionally (hot path)
        now = time.perf_counter()
        last = self._last_handout
        if last is not None:
            self.consumer_s += max(now - last - wait_s, 0.0)
        self._last_handout = now
        self.wait_s += wait_s
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = WorkerStats()
        w.batches += 1
        w.fetch_s += fetch_s
        w.collate_s += collate_s
        w.bytes += nbytes
        occ = self.occupancy
        occ.ready_sum += ready
        occ.in_flight_sum += in_flight
        if ready > occ.max_ready:
            occ.max_ready = ready
        if slots > occ.max_slots:
            occ.max_slots = slots

    @hookimpl(trylast=True)
    def shmloader_epoch_end(self) -> None:
        self._last_handout = None  # the time between epochs is neither waiting nor consuming

    # -- report -----------------------------------------------------------------------------
    @property
    def batches(self) -> int:
        """Batches handed out, across workers (derived: the per-worker totals are the record)."""
        return sum(w.batches for w in self.workers.values())

    @property
    def bytes(self) -> int:
        return sum(w.bytes for w in self.workers.values())

    def count_epoch(self) -> int:
        """Count an ended epoch (before observers see it); returns its index from 0."""
        self.epochs += 1
        return self.epochs - 1

    def summary(self) -> dict[str, Any]:
        """``loader.stats()``: totals, per-worker timings, slot occupancy and the verdict."""
        batches = self.batches
        n = max(batches, 1)
        occ = self.occupancy
        return {
            "batches": batches, "bytes": self.bytes, "epochs": self.epochs,
            "wait_s": round(self.wait_s, 6), "consumer_s": round(self.consumer_s, 6),
            "worker_starts": self.worker_starts, "worker_deaths": self.worker_deaths,
            "worker_restarts": self.worker_restarts,
            "workers": {
                wid: {"batches": w.batches, "fetch_s": round(w.fetch_s, 6),
                      "collate_s": round(w.collate_s, 6), "bytes": w.bytes}
                for wid, w in sorted(self.workers.items())
            },
            "slots": {"mean_ready": round(occ.ready_sum / n, 3), "max_ready": occ.max_ready,
                      "mean_in_flight": round(occ.in_flight_sum / n, 3), "max_slots": occ.max_slots},
            "bottleneck": self.verdict(),
        }

    def verdict(self) -> str:
        """One line: is the consumer starved by data loading, or is the consumer the slower side?"""
        if self.batches == 0:
            return "no batches yet: nothing measured"
        span = self.wait_s + self.consumer_s
        share = self.wait_s / span if span > 0 else 0.0
        if share > LOADING_BOUND_SHARE:
            return (f"data loading is the bottleneck: the consumer spent {share:.0%} of its time waiting "
                    "for batches (more workers or a cheaper dataset/collate would help)")
        return (f"the consumer is the bottleneck: it waited for batches only {share:.0%} of its time "
                "(faster loading would not speed it up)")
