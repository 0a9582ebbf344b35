"""Waiting on workers and recovering from their faults: step 3 of the multi-process iterator.

Owns nothing of its own: a mixin of ``MultiProcessIter`` (``mp_iterator.py``), which holds the
pool, the ring, the reorder buffer and the task records it reads and changes. Runs in the main
process. Promises: ONE blocking ``multiprocessing.connection.wait`` over every worker's reply pipe
and process sentinel, bounded only by ``timeout=`` and the per-task hang deadline, so a death is
seen at once; each reply is processed exactly once; a death is turned by ``faults`` into an error
or into a replacement worker that gets the dead one's tasks again, each task delivered once.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from shmloader.engine import faults
from shmloader.engine.workers import WorkerHandle
from shmloader.errors import describe_exit
from shmloader.log import logger
from shmloader.transport.messages import Exhausted, Failed, Filled, Ready, TooSmall
from shmloader.transport.ring import Slot
from shmloader.transport.segment import explain_enospc, page_round

GROWTH = 1.25  # a slot that was too small grows to this multiple of the bytes the batch needed


@dataclass(eq=False)
class TaskRecord:
    task: int
    indices: list[Any] | None
    slot: Slot
    worker_id: int = -1
    attempts: int = 0
    deaths: list[str] = field(default_factory=list)


class WaitAndRecover:
    """Step 3 of ``MultiProcessIter``: wait, process replies, handle deaths and hangs."""

    # state and steps of MultiProcessIter that this mixin reads and calls
    _pool: Any
    _ring: Any
    _reorder: Any
    _loader: Any
    _cfg: Any
    _events: Any
    _inflight: dict[tuple[int, int], TaskRecord]
    _policy: faults.FaultPolicy
    _epoch: int
    _iterable: bool
    _timeout: float
    _restarts: int
    _slot_bytes: int
    _fail: Callable[[BaseException], BaseException]
    _send: Callable[[WorkerHandle, TaskRecord], None]
    _flush_detach: Callable[[], None]
    _capacity: Callable[[], int]
    _worker_exception: Callable[[Failed, int, TaskRecord | None], BaseException]

    # -- 3. wait and process -------------------------------------------------------------------
    # A death the policy turns into an error is raised at the next wait, so batches that were
    # complete before it (drained in the same wait) are handed out first, as torch hands them out.
    _fault: BaseException | None = None

    def _wait(self, started: float) -> None:
        if self._fault is not None:
            fault, self._fault = self._fault, None
            raise self._fail(fault)
        workers = list(self._pool.workers)
        by_conn = {w.results: w for w in workers}
        by_sentinel = {w.process.sentinel: w for w in workers}
        ready = wait([*by_conn, *by_sentinel], self._wait_timeout(started))
        if not ready:
            self._on_quiet(started)
            return
        dead: list[WorkerHandle] = []
        for obj in ready:
            w = by_conn.get(obj)  # type: ignore[call-overload]
            if w is None:
                dead.append(by_sentinel[obj])  # type: ignore[index]
            elif not self._drain(w):
                dead.append(w)
        for w in dict.fromkeys(dead):
            if self._fault is None and self._pool.workers[w.id] is w:
                self._drain(w)
                self._on_death(w, cause=None)

    def _wait_timeout(self, started: float) -> float | None:
        deadlines = []
        if self._timeout > 0:
            deadlines.append(started + self._timeout)
        if self._policy.task_timeout_s > 0:
            deadlines += [w.head_since + self._policy.deadline_s(w.ready) for w in self._pool.workers
                          if w.outstanding]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _drain(self, w: WorkerHandle) -> bool:
        """Process every reply waiting on ``w``'s pipe; False when the pipe is closed (worker gone)."""
        try:
            while w.results.poll():
                self._process(w, w.results.recv())
        except (EOFError, OSError):
            return False
        return True

    def _process(self, w: WorkerHandle, msg: Any) -> None:
        if isinstance(msg, Ready):
            w.ready = True
            w.head_since = time.monotonic()  # the first task's deadline starts now, not at dispatch
            return
        if isinstance(msg, Failed) and msg.task is None:
            # before Ready: start-up failed; after: the next task could not be unpickled, and
            # replies come in task order, so that task is the oldest one the worker holds
            head = self._inflight.get(w.outstanding[0]) if w.ready and w.outstanding else None
            raise self._fail(self._worker_exception(msg, w.id, head))
        key = (msg.epoch, msg.task)
        rec = self._inflight.get(key)
        if rec is None:
            return
        stale = msg.epoch != self._epoch
        if isinstance(msg, TooSmall) and not stale:
            self._regrow(w, key, rec, msg.needed_bytes)
            return
        w.pop(key)
        del self._inflight[key]
        if stale or not isinstance(msg, (Filled, Failed)):
            self._ring.free(rec.slot)
            if isinstance(msg, Exhausted) and not stale:
                w.exhausted = True
                self._reorder.skip(rec.task)
                if all(h.exhausted for h in self._pool.workers):
                    self._sampler_done = True
            return
        if isinstance(msg, Failed):
            self._ring.free(rec.slot)
        else:
            self._ring.fill(rec.slot)
        self._reorder.put(rec.task, (rec, msg))

    def _regrow(self, w: WorkerHandle, key: tuple[int, int], rec: TaskRecord, needed: int) -> None:
        """The batch did not fit: a larger slot for this task (and every later one), same worker."""
        self._slot_bytes = max(self._slot_bytes, page_round(int(needed * GROWTH)))
        try:
            self._loader._preflight(self._ring, self._slot_bytes, self._capacity() + 2)
            with explain_enospc(self._ring.shm_dir, self._slot_bytes):
                self._ring.resize(rec.slot, self._slot_bytes)
        except Exception as exc:  # no room: the loader is broken; shut it before raising
            raise self._fail(exc)
        self._flush_detach()
        w.pop(key)
        self._send(w, rec)

    def _on_quiet(self, started: float) -> None:
        """The wait timed out: a hung worker (task deadline) or the loader's ``timeout=``."""
        now = time.monotonic()
        for w in list(self._pool.workers):
            limit = self._policy.deadline_s(w.ready)
            if limit > 0 and w.outstanding and now >= w.head_since + limit:
                self._kill_hung(w, limit)
                return
        if self._timeout > 0 and now >= started + self._timeout:
            held = {w.id: w.pid for w in self._pool.workers if w.outstanding}
            raise self._fail(faults.timed_out(self._timeout, self._tasks_of(None), held))

    def _kill_hung(self, w: WorkerHandle, limit_s: float) -> None:
        key = w.outstanding[0]
        rec = self._inflight.get(key)
        logger.warning("worker %d (pid %s) spent more than %s s on %s; killing it", w.id, w.pid, limit_s,
                       f"task {key[1]}" if w.ready else "start-up")
        try:
            os.kill(w.pid or 0, signal.SIGKILL)
        except ProcessLookupError:
            pass
        w.process.join()
        if not self._policy.restart or self._iterable:
            raise self._fail(faults.hung(w.id, w.pid, key[1], rec.indices if rec else None, limit_s,
                                         starting=not w.ready, iterable=self._iterable))
        self._on_death(w, cause=f"hung for more than {limit_s} s and was killed")

    def _tasks_of(self, w: WorkerHandle | None) -> dict[int, Any]:
        keys = w.outstanding if w is not None else list(self._inflight)
        return {k[1]: self._inflight[k].indices for k in keys if k in self._inflight and k[0] == self._epoch}

    def _on_death(self, w: WorkerHandle, cause: str | None) -> None:
        """A worker died: note the error it becomes (raised at the next wait), or replace it."""
        w.process.join(1.0)
        exitcode = w.process.exitcode
        tasks = self._tasks_of(w)
        self._events.worker_died(w.id, w.pid, exitcode, tasks)
        self._fault = self._death_fault(w, exitcode, tasks, cause)
        if self._fault is None:
            self._restart(w)

    def _death_fault(self, w: WorkerHandle, exitcode: int | None, tasks: dict[int, Any],
                     cause: str | None) -> BaseException | None:
        """The error a death becomes under the policy, or None when the worker is to be replaced."""
        starting = not w.ready
        if not self._policy.restart or self._iterable:
            return faults.died(w.id, w.pid, exitcode, tasks, self._cfg.shm_dir, iterable=self._iterable,
                               starting=starting)
        self._restarts += 1
        if self._restarts > self._policy.max_restarts:
            return faults.budget_spent(w.id, w.pid, exitcode, tasks, self._policy.max_restarts, starting=starting)
        if starting:  # a death during start-up is not the waiting task's fault
            return None
        return self._blame_head(w, cause or f"died with {describe_exit(exitcode)}")

    def _restart(self, w: WorkerHandle) -> None:
        """Start a successor under the same id and re-send, in order, every task the dead one held."""
        keys = list(w.outstanding)
        new = self._pool.replace(w.id)
        self._events.worker_restarted(new.id, new.pid, w.pid)
        for key in keys:
            rec = self._inflight.pop(key, None)
            if rec is None:
                continue
            if key[0] != self._epoch:
                self._ring.free(rec.slot)
            else:
                self._send(new, rec)

    def _blame_head(self, w: WorkerHandle, cause: str) -> BaseException | None:
        """The task a worker was running when it died counts an attempt; too many make it poison."""
        if not w.outstanding:
            return None
        rec = self._inflight.get(w.outstanding[0])
        if rec is None or w.outstanding[0][0] != self._epoch:
            return None
        rec.attempts += 1
        rec.deaths.append(f"worker {w.id} (pid {w.pid}) {cause}")
        if rec.attempts >= self._policy.max_task_attempts:
            return faults.poison(rec.task, rec.indices, rec.attempts, rec.deaths)
        return None
