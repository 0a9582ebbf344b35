"""Module-level datasets and plugins for the plugin tests (importable by spawned workers)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from shmloader.hookspecs import hookimpl

EXAMPLE_SRC = Path(__file__).resolve().parent.parent / "examples" / "shmloader-example-plugin" / "src"


class TokenDataset:
    """Sample i: Tokens of length i % 5 + 1 with ids i+1 ... (needs the example package importable)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        from shmloader_example_plugin import Tokens

        return Tokens(np.full(i % 5 + 1, i + 1, dtype=np.int32))


class Point:
    """A custom sample type with no built-in rule."""

    def __init__(self, x: float, y: float) -> None:
        self.x, self.y = x, y


class PointDataset:
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Point:
        return Point(float(i), float(-i))


def collate_points(batch: list[Point], ctx: Any) -> np.ndarray:
    """Points become one (batch, 3) float64 array from the slot: x, y and the collating pid."""
    out = ctx.alloc((len(batch), 3), np.dtype(np.float64))
    for row, p in zip(out, batch):
        row[:] = (p.x, p.y, os.getpid())
    return out


class PointRules:
    """An explicit plugin contributing the Point rule."""

    @hookimpl
    def shmloader_collate_rules(self) -> dict[type, Any]:
        return {Point: collate_points}


class Recorder:
    """An observer that records every event it sees (main process)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    @hookimpl
    def shmloader_worker_started(self, worker_id: int, pid: int | None) -> None:
        self.events.append(("started", {"worker_id": worker_id, "pid": pid}))

    @hookimpl
    def shmloader_worker_died(self, worker_id: int, pid: int | None, exitcode: int | None, tasks: dict) -> None:
        self.events.append(("died", {"worker_id": worker_id, "pid": pid, "exitcode": exitcode, "tasks": tasks}))

    @hookimpl
    def shmloader_worker_restarted(self, worker_id: int, pid: int | None, old_pid: int | None) -> None:
        self.events.append(("restarted", {"worker_id": worker_id, "pid": pid, "old_pid": old_pid}))

    @hookimpl
    def shmloader_batch_ready(self, task: int, worker_id: int, nbytes: int, fetch_s: float, collate_s: float,
                              wait_s: float) -> None:
        self.events.append(("batch", {"task": task, "worker_id": worker_id, "nbytes": nbytes, "fetch_s": fetch_s,
                                      "collate_s": collate_s, "wait_s": wait_s}))

    @hookimpl
    def shmloader_epoch_end(self, epoch: int, stats: dict[str, Any]) -> None:
        self.events.append(("epoch_end", {"epoch": epoch, "stats": stats}))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.events]


class DiesOnce:
    """Sample 5 kills its worker the first time it is fetched (a marker file remembers)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        if i == 5 and not os.path.exists(self.marker):
            Path(self.marker).touch()
            os._exit(3)
        return i


class Boom:
    """An observer that raises on the third batch."""

    def __init__(self) -> None:
        self.seen = 0

    def shmloader_batch_ready(self) -> None:  # unmarked: the shmloader_ prefix is enough
        self.seen += 1
        if self.seen == 3:
            raise ValueError("observer exploded")


def rule_names_in_this_process() -> list[str]:
    """What a worker starting here would add from its own plugins (run in a fresh spawned process)."""
    from shmloader.plugins import worker_collate_rules

    return sorted(f"{k.__module__}.{k.__qualname__}" for k in worker_collate_rules({}))


class CloseOnBatch:
    """Closes ``loader`` from its hook for task 1, inside that ``next()``: the iterator closes as
    that ``next()`` returns (docs/design/ownership.md)."""

    loader: Any = None

    @hookimpl
    def shmloader_batch_ready(self, task: int) -> None:
        if task == 1:
            self.loader.close()
