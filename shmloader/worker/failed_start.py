"""A worker whose start-up failed: it answers each task with that failure, in its turn; and a
``worker_init_fn`` that raised, which fails one task only.

Runs in a worker process whose dataset did not unpickle, whose seeding failed or whose
``worker_init_fn`` raised a ``BaseException`` that is no ``Exception`` (``sys.exit()``). Owns the failure (a ``Failed`` with ``starting`` set) and the epoch of
the last ``Reset``. Promises: it reads no dataset and writes no slot; each task is answered with
the failure under that task's number, so the main process raises it where the worker's first task
is due, after every batch before it, as torch's worker answers its first index with its
``worker_init_fn``'s exception (before, it was raised as it was read, in place of a batch another
worker had made: tests/test_start_failure_order.py). A task that did not unpickle is answered with
task None: the main process takes it for the oldest task the worker holds.

A ``worker_init_fn`` that raises an ``Exception`` is no failed start (:func:`run_init`): as torch's
worker (``_worker_loop`` catches it and answers its first index with it), the worker answers its
first task with it, once, and serves the others without its init; persistent, it is not started
again, so the init does not run again (tests/test_worker_init_fails.py).
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from typing import Any, Callable

from shmloader.transport import exc_types
from shmloader.transport.messages import Failed, Task


def failure(epoch: int, task: int | None, exc_info: Any, starting: bool = False, init: bool = False) -> Failed:
    """The ``Failed`` reply that carries the exception ``exc_info`` (its type, pickled when it can
    be, and its traceback's text)."""
    exc_type, exc, tb = exc_info
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    return Failed(epoch, task, exc_type.__name__, exc_types.dumps(exc_type), text, starting, init)


def run_init(worker_init_fn: Callable[[int], None] | None, worker_id: int) -> Failed | None:
    """Call ``worker_init_fn(worker_id)``; the reply its ``Exception`` makes of the worker's first
    task, or None. Any other ``BaseException`` (``sys.exit()``) propagates: a failed start."""
    if worker_init_fn is None:
        return None
    try:
        worker_init_fn(worker_id)
    except Exception:
        return failure(0, None, sys.exc_info(), init=True)
    return None


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

