"""Worker processes as the main process sees them: start, message, replace, stop.

Owns each worker's process and its two one-way pipes (tasks out, replies in; no
``multiprocessing.Queue`` and so no feeder threads) and the FIFO of tasks each worker holds.
Runs in the main process. Promises: ``shutdown`` leaves no process (stop message, bounded join,
then SIGTERM, then SIGKILL) and no open pipe, and reaps every child it started, so none is left a
zombie; a worker is started the same way the first time and on a restart (same id, same seed,
``worker_init_fn`` re-run). A handle knows whether its worker has finished starting (``ready``), so
a death during start-up is not blamed on the task that waited for it.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

from shmloader.log import logger
from shmloader.worker import main as worker_main

_JOIN_TIMEOUT_S = 1.0
_KILL_TIMEOUT_S = 1.0


@dataclass(eq=False)
class WorkerHandle:
    """One live worker: its process, pipes and the tasks it holds (oldest first)."""

    id: int
    process: Any
    tasks: Connection
    results: Connection
    outstanding: deque[tuple[int, int]] = field(default_factory=deque)  # (epoch, task)
    head_since: float = 0.0  # when the oldest outstanding task became the one it works on
    exhausted: bool = False
    generation: int = 0
    ready: bool = False  # the worker said Ready: dataset loaded, seeded, worker_init_fn done

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def send(self, msg: Any) -> None:
        self.tasks.send(msg)

    def push(self, key: tuple[int, int]) -> None:
        if not self.outstanding:
            self.head_since = time.monotonic()
        self.outstanding.append(key)

    def pop(self, key: tuple[int, int]) -> None:
        try:
            self.outstanding.remove(key)
        except ValueError:
            return
        self.head_since = time.monotonic()


class WorkerPool:
    """Starts and stops the workers of one iterator (or of a loader, with persistent workers)."""

    def __init__(self, ctx: BaseContext, spec: worker_main.WorkerSpec, num_workers: int) -> None:
        self.ctx = ctx
        self.num_workers = num_workers
        fork = ctx.get_start_method() == "fork"
        if fork:
            self._payload: Any = spec
        else:
            import cloudpickle

            self._payload = cloudpickle.dumps(spec)
        self.workers: list[WorkerHandle] = []
        self.restarts = 0

    def start_all(self) -> None:
        self.workers = [self._start(i) for i in range(self.num_workers)]

    def _start(self, worker_id: int, generation: int = 0) -> WorkerHandle:
        task_r, task_w = self.ctx.Pipe(duplex=False)
        res_r, res_w = self.ctx.Pipe(duplex=False)
        process = self.ctx.Process(  # type: ignore[attr-defined]
            target=worker_main.run,
            args=(self._payload, worker_id, task_r, res_w, os.getpid()),
            name=f"shmloader-worker-{worker_id}",
            daemon=True,
        )
        process.start()
        task_r.close()
        res_w.close()
        logger.info("worker %d started (pid %s)", worker_id, process.pid)
        return WorkerHandle(worker_id, process, task_w, res_r, generation=generation)

    def replace(self, worker_id: int) -> WorkerHandle:
        """Reap a dead worker and start its successor under the same id."""
        old = self.workers[worker_id]
        _reap(old)
        self.restarts += 1
        new = self._start(worker_id, old.generation + 1)
        self.workers[worker_id] = new
        logger.info("worker %d restarted (pid %s replaces %s)", worker_id, new.pid, old.pid)
        return new

    def alive(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.process.exitcode is None]

    def broadcast(self, msg: Any) -> None:
        for w in self.workers:
            try:
                w.send(msg)
            except (BrokenPipeError, OSError):
                pass  # a dead worker is noticed through its sentinel

    def shutdown(self, grace_s: float = _JOIN_TIMEOUT_S) -> None:
        """Stop every worker: polite message, join within ``grace_s``, then terminate and kill.

        A broken loader passes a short ``grace_s``: a hung worker would only waste the wait.
        """
        workers, self.workers = self.workers, []
        for w in workers:
            try:
                w.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + grace_s
        for w in workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
        for w in workers:
            _reap(w)
            logger.info("worker %d exited (pid %s, exit code %s)", w.id, w.pid, w.process.exitcode)


def _reap(w: WorkerHandle) -> None:
    """Make sure the process is gone and joined, and close its pipes."""
    p = w.process
    if p.exitcode is None:
        p.terminate()
        _continue(p.pid)  # a stopped worker (SIGSTOP) acts on SIGTERM only once continued
        p.join(_KILL_TIMEOUT_S)
    if p.exitcode is None:
        p.kill()
        p.join()
    else:
        p.join()
    for conn in (w.tasks, w.results):
        try:
            conn.close()
        except OSError:
            pass


def _continue(pid: int | None) -> None:
    if not pid:
        return
    try:
        os.kill(pid, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass
