"""Loader events and the statistics built from them.

Owns ``Events``, the one object the iterators report to (worker started / died / restarted,
batch ready, epoch end, time the consumer waited), and ``Stats``, the built-in observer that turns
those events into ``loader.stats()``. Runs in the main process; ``batch_ready`` is on the hot path,
so an observer must be cheap. Third-party observers are called through the plugin manager
(``plugins.py``) when one is configured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkerStats:
    batches: int = 0
    fetch_s: float = 0.0
    collate_s: float = 0.0
    bytes: int = 0


@dataclass
class Stats:
    """Counters of one loader, across its epochs."""

    batches: int = 0
    bytes: int = 0
    wait_s: float = 0.0
    epochs: int = 0
    worker_starts: int = 0
    worker_deaths: int = 0
    worker_restarts: int = 0
    workers: dict[int, WorkerStats] = field(default_factory=dict)
    started_at: float = field(default_factory=time.perf_counter)

    def summary(self, slots: dict[str, int] | None = None) -> dict[str, Any]:
        elapsed = max(time.perf_counter() - self.started_at, 1e-9)
        per_worker = {
            wid: {"batches": w.batches, "fetch_s": round(w.fetch_s, 6), "collate_s": round(w.collate_s, 6),
                  "bytes": w.bytes}
            for wid, w in sorted(self.workers.items())
        }
        wait_share = self.wait_s / elapsed
        verdict = (
            f"data loading is the bottleneck: the consumer waited {wait_share:.0%} of the time"
            if wait_share > 0.2 else
            f"the consumer is the bottleneck: it waited for data only {wait_share:.0%} of the time"
        )
        return {
            "batches": self.batches, "bytes": self.bytes, "wait_s": round(self.wait_s, 6),
            "elapsed_s": round(elapsed, 6), "epochs": self.epochs, "worker_starts": self.worker_starts,
            "worker_deaths": self.worker_deaths, "worker_restarts": self.worker_restarts,
            "workers": per_worker, "slots": dict(slots or {}), "bottleneck": verdict,
        }


class Events:
    """Receives every loader event; feeds ``Stats`` and any observer plugins."""

    def __init__(self, hook: Any = None) -> None:
        self.stats = Stats()
        self.hook = hook  # a pluggy HookRelay, or None

    def worker_started(self, worker_id: int, pid: int | None) -> None:
        self.stats.worker_starts += 1
        if self.hook is not None:
            self.hook.shmloader_worker_started(worker_id=worker_id, pid=pid)

    def worker_died(self, worker_id: int, pid: int | None, exitcode: int | None, tasks: dict) -> None:
        self.stats.worker_deaths += 1
        if self.hook is not None:
            self.hook.shmloader_worker_died(worker_id=worker_id, pid=pid, exitcode=exitcode, tasks=tasks)

    def worker_restarted(self, worker_id: int, pid: int | None, old_pid: int | None) -> None:
        self.stats.worker_restarts += 1
        self.stats.worker_starts += 1
        if self.hook is not None:
            self.hook.shmloader_worker_restarted(worker_id=worker_id, pid=pid, old_pid=old_pid)

    def batch_ready(self, task: int, worker_id: int, nbytes: int, fetch_s: float, collate_s: float,
                    wait_s: float) -> None:
        s = self.stats
        s.batches += 1
        s.bytes += nbytes
        s.wait_s += wait_s
        w = s.workers.get(worker_id)
        if w is None:
            w = s.workers[worker_id] = WorkerStats()
        w.batches += 1
        w.fetch_s += fetch_s
        w.collate_s += collate_s
        w.bytes += nbytes
        if self.hook is not None:
            self.hook.shmloader_batch_ready(task=task, worker_id=worker_id, nbytes=nbytes, fetch_s=fetch_s,
                                            collate_s=collate_s, wait_s=wait_s)

    def epoch_end(self, epoch: int) -> None:
        self.stats.epochs += 1
        if self.hook is not None:
            self.hook.shmloader_epoch_end(epoch=epoch, stats=self.stats.summary())
