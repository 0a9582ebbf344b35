"""A worker whose start-up failed: it answers each task with that failure, in its turn.

Runs in a worker process whose dataset did not unpickle, whose seeding failed or whose
``worker_init_fn`` raised. Owns the failure (a ``Failed`` with ``starting`` set) and the epoch of
the last ``Reset``. Promises: it reads no dataset and writes no slot; each task is answered with
the failure under that task's number, so the main process raises it where the worker's first task
is due, after every batch before it, as torch's worker answers its first index with its
``worker_init_fn``'s exception (before, it was raised as it was read, in place of a batch another
worker had made: tests/test_start_failure_order.py). A task that did not unpickle is answered with
task None: the main process takes it for the oldest task the worker holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shmloader.transport.messages import Failed, Task


class FailedStart:
    """What ``worker.main.serve`` runs in place of a worker that could not start."""

    def __init__(self, failure: Failed) -> None:
        self.failure = failure
        self.epoch = failure.epoch

    def handle(self, task: Task) -> Failed:
        return dataclasses.replace(self.failure, epoch=task.epoch, task=task.task)

    def undecodable(self, exc_info: Any) -> Failed:
        return dataclasses.replace(self.failure, epoch=self.epoch, task=None)

    def reset(self, epoch: int, seed: int | None = None) -> None:
        self.epoch = epoch

    def detach(self, names: tuple[str, ...]) -> None:
        """Nothing to unmap: it maps no segment."""

    def detach_all(self) -> None:
        """Nothing to unmap: it maps no segment."""

