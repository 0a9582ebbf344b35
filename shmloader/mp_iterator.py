"""The multi-process iterator: dispatch tasks, wait on workers, reorder, hand out leased views.

Runs in the main process. Owns the worker pool and the slot ring of one loader (kept across
epochs with ``persistent_workers``) and one record per task in flight. A small state machine:
running → exhausted (epoch over) | broken (a fault was raised; workers and ring are shut) |
closed. Each ``__next__`` runs these steps until a batch is due:

1. ``dispatch``: while fewer than ``prefetch_factor × workers`` tasks are in the pipeline, take
   the next indices from the sampler, a free slot from the ring (growing it when the user holds
   the others) and send a task to the worker with the fewest outstanding (round-robin for an
   iterable dataset, whose interleaving is torch's);
2. ``pop``: if the reorder buffer has the next batch due, lease its slot and decode its views;
3. ``wait``: block in ONE ``multiprocessing.connection.wait`` over every worker's reply pipe and
   process sentinel, bounded only by ``timeout=`` and the per-task hang deadline; then
   ``process`` each reply, and handle each death through ``faults`` (raise, or replace the worker
   and re-send its tasks to it).

See docs/design/slot-lifecycle.md for the ownership rules this keeps.
"""

from __future__ import annotations

import atexit
import os
import signal
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from . import codec, faults
from .errors import describe_exit, rebuild_worker_exception
from .iterator import BaseIter, IterState
from .log import logger
from .messages import Detach, Exhausted, Failed, Filled, Ready, Reset, SlotRef, Task, TooSmall
from .reorder import Reorder
from .ring import Ring, Slot
from .segment import page_round
from .worker_info import task_seed
from .workers import WorkerHandle, WorkerPool

FIRST_SLOT_BYTES = 1 << 20
_GROWTH = 1.25
_live: weakref.WeakSet[MultiProcessIter] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for it in list(_live):
        it.close()


@dataclass(eq=False)
class TaskRecord:
    task: int
    indices: list[Any] | None
    slot: Slot
    worker_id: int = -1
    attempts: int = 0
    deaths: list[str] = field(default_factory=list)


class MultiProcessIter(BaseIter):
    def __init__(self, loader: Any) -> None:
        super().__init__(loader)
        cfg = loader._config
        self._cfg = cfg
        self._prefetch: int = loader.prefetch_factor
        self._timeout: float = float(loader.timeout)
        self._in_order: bool = loader.in_order
        self._policy = faults.FaultPolicy(cfg.on_worker_death, cfg.max_restarts, cfg.max_task_attempts,
                                          cfg.task_timeout_s)
        self._events = loader._events
        self._epoch = 0
        self._slot_bytes = page_round(cfg.slot_bytes) if cfg.slot_bytes else FIRST_SLOT_BYTES
        self._ring = loader._make_ring()
        self._inflight: dict[tuple[int, int], TaskRecord] = {}
        if cfg.slot_bytes:
            loader._preflight(self._ring, self._slot_bytes, self._capacity() + 2)
        self._pool = WorkerPool(loader._mp_context, loader._worker_spec(self._base_seed), self._num_workers)
        _live.add(self)
        try:
            self._pool.start_all()
        except BaseException:
            self.close()
            raise
        for w in self._pool.workers:
            self._events.worker_started(w.id, w.pid)
        self._begin_epoch()

    # -- epoch life cycle ----------------------------------------------------------------------
    def _begin_epoch(self) -> None:
        self._reorder: Reorder[tuple[TaskRecord, Any]] = Reorder(self._in_order)
        self._next_task = 0
        self._sampler_done = False
        self._restarts = 0
        self._rr = 0
        self._state = IterState.RUNNING

    def _reset(self, loader: Any) -> None:
        """Next epoch on the same workers (persistent_workers); an abandoned epoch is reclaimed."""
        super()._reset(loader)
        for rec, _msg in self._reorder.drain():
            self._ring.free(rec.slot)
        self._epoch += 1
        if self._iterable:
            self._pool.broadcast(Reset(self._epoch))
            for w in self._pool.workers:
                w.exhausted = False
        self._begin_epoch()

    @property
    def closed(self) -> bool:
        return self._state in (IterState.CLOSED, IterState.BROKEN)

    def close(self) -> None:
        """Stop every worker and unlink every segment (views the user holds stay valid)."""
        if self._state is IterState.CLOSED:
            return
        self._state = IterState.CLOSED
        self._pool.shutdown()
        self._ring.close()
        _live.discard(self)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _fail(self, exc: BaseException) -> BaseException:
        """Shut down and mark broken; returns ``exc`` for the caller to raise."""
        self.close()
        self._state = IterState.BROKEN
        return exc

    # -- the step loop -------------------------------------------------------------------------
    def _next_data(self) -> Any:
        if self._state is not IterState.RUNNING:
            raise StopIteration
        started = self._started = time.monotonic()
        try:
            while True:
                self._dispatch()
                item = self._reorder.pop()
                if item is not None:
                    return self._deliver(*item)
                if self._finished():
                    self._end_epoch()
                    raise StopIteration
                self._wait(started)
        except (KeyboardInterrupt, SystemExit):
            self.close()
            raise

    def _finished(self) -> bool:
        return self._sampler_done and not self._current_inflight() and not len(self._reorder)

    def _end_epoch(self) -> None:
        self._state = IterState.EXHAUSTED
        self._events.epoch_end(self._epoch)
        if not self._loader.persistent_workers:
            self.close()

    def _current_inflight(self) -> int:
        return sum(1 for (epoch, _t) in self._inflight if epoch == self._epoch)

    def _capacity(self) -> int:
        active = sum(1 for w in self._pool.workers if not w.exhausted) if self._pool.workers else self._num_workers
        return self._prefetch * max(active, 0)

    # -- 1. dispatch ---------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while not self._sampler_done and self._current_inflight() + len(self._reorder) < self._capacity():
            worker = self._pick_worker()
            if worker is None:
                return
            try:
                indices = self._next_indices()
            except StopIteration:
                self._sampler_done = True
                return
            rec = TaskRecord(self._next_task, indices, self._take_slot())
            self._next_task += 1
            self._send(worker, rec)

    def _next_indices(self) -> list[Any] | None:
        batch = next(self._sampler_iter)
        if self._iterable:
            return None
        return list(batch) if self._auto_collation else [batch]

    def _pick_worker(self) -> WorkerHandle | None:
        workers = self._pool.workers
        n = len(workers)
        if self._iterable:
            for _ in range(n):
                w = workers[self._rr % n]
                if not w.exhausted:
                    break
                self._rr += 1
            else:
                self._sampler_done = True
                return None
        else:
            w = min((workers[(self._rr + i) % n] for i in range(n)), key=lambda h: len(h.outstanding))
        if len(w.outstanding) >= self._prefetch:
            return None
        self._rr = (w.id + 1) % n
        return w

    def _take_slot(self) -> Slot:
        slot = self._ring.take(self._slot_bytes)
        if slot is None:
            slot = self._ring.grow(self._slot_bytes)
        self._flush_detach()
        return slot

    def _send(self, worker: WorkerHandle, rec: TaskRecord) -> None:
        rec.worker_id = worker.id
        rec.slot.task = rec.task
        key = (self._epoch, rec.task)
        self._inflight[key] = rec
        worker.push(key)
        seed = task_seed(self._base_seed, self._epoch, rec.task) if self._cfg.task_seeding else None
        slot = rec.slot
        try:
            worker.send(Task(self._epoch, rec.task, rec.indices, SlotRef(slot.id, slot.segment.name,
                                                                          slot.size_bytes), seed))
        except (BrokenPipeError, OSError):
            pass  # the worker is dead: its sentinel reports it and the task is handled there

    def _flush_detach(self) -> None:
        if self._ring.retired_names:
            self._pool.broadcast(Detach(tuple(self._ring.retired_names)))
            self._ring.retired_names.clear()

    # -- 2. deliver ----------------------------------------------------------------------------
    def _deliver(self, rec: TaskRecord, msg: Any) -> Any:
        if isinstance(msg, Failed):
            raise self._worker_exception(msg, rec.worker_id, rec)
        buf = self._ring.lease(rec.slot)
        batch, _views = codec.decode(msg.payload, buf, rec.slot.size_bytes)
        del buf  # the views alone keep the slot now; none at all frees it
        self._events.batch_ready(rec.task, rec.worker_id, msg.nbytes, msg.fetch_s, msg.collate_s,
                                 time.monotonic() - self._started)
        return self._loader._finish_batch(batch)

    def _worker_exception(self, msg: Failed, worker_id: int, rec: TaskRecord | None) -> BaseException:
        exc_type = None
        if msg.exc_type is not None:
            try:
                import pickle

                exc_type = pickle.loads(msg.exc_type)
            except Exception:
                exc_type = None
        pid = self._pool.workers[worker_id].pid if worker_id < len(self._pool.workers) else None
        return rebuild_worker_exception(exc_type, msg.type_name, msg.traceback, worker_id=worker_id, pid=pid,
                                        task=None if rec is None else rec.task,
                                        indices=None if rec is None else rec.indices)

    # -- 3. wait and process -------------------------------------------------------------------
    def _wait(self, started: float) -> None:
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
            if self._pool.workers[w.id] is w:
                self._drain(w)
                self._on_death(w, cause=None)

    def _wait_timeout(self, started: float) -> float | None:
        deadlines = []
        if self._timeout > 0:
            deadlines.append(started + self._timeout)
        if self._policy.task_timeout_s > 0:
            deadlines += [w.head_since + self._policy.task_timeout_s for w in self._pool.workers if w.outstanding]
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
            return
        if isinstance(msg, Failed) and msg.task is None:
            raise self._fail(self._worker_exception(msg, w.id, None))
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
            return
        if isinstance(msg, Failed):
            self._ring.free(rec.slot)
        else:
            self._ring.fill(rec.slot)
        self._reorder.put(rec.task, (rec, msg))

    def _regrow(self, w: WorkerHandle, key: tuple[int, int], rec: TaskRecord, needed: int) -> None:
        """The batch did not fit: a larger slot for this task (and every later one), same worker."""
        self._slot_bytes = max(self._slot_bytes, page_round(int(needed * _GROWTH)))
        self._loader._preflight(self._ring, self._slot_bytes, self._capacity() + 2)
        self._ring.resize(rec.slot, self._slot_bytes)
        self._flush_detach()
        w.pop(key)
        self._send(w, rec)

    def _on_quiet(self, started: float) -> None:
        """The wait timed out: a hung worker (task deadline) or the loader's ``timeout=``."""
        now = time.monotonic()
        limit = self._policy.task_timeout_s
        for w in list(self._pool.workers):
            if limit > 0 and w.outstanding and now >= w.head_since + limit:
                self._kill_hung(w)
                return
        if self._timeout > 0 and now >= started + self._timeout:
            held = {w.id: w.pid for w in self._pool.workers if w.outstanding}
            raise self._fail(faults.timed_out(self._timeout, self._tasks_of(None), held))

    def _kill_hung(self, w: WorkerHandle) -> None:
        key = w.outstanding[0]
        rec = self._inflight.get(key)
        logger.warning("worker %d (pid %s) exceeded task_timeout_s on task %s; killing it", w.id, w.pid, key[1])
        try:
            os.kill(w.pid or 0, signal.SIGKILL)
        except ProcessLookupError:
            pass
        w.process.join()
        if not self._policy.restart or self._iterable:
            raise self._fail(faults.hung(w.id, w.pid, key[1], rec.indices if rec else None,
                                         self._policy.task_timeout_s))
        self._on_death(w, cause=f"hung past task_timeout_s={self._policy.task_timeout_s}")

    def _tasks_of(self, w: WorkerHandle | None) -> dict[int, Any]:
        keys = w.outstanding if w is not None else list(self._inflight)
        return {k[1]: self._inflight[k].indices for k in keys if k in self._inflight and k[0] == self._epoch}

    def _on_death(self, w: WorkerHandle, cause: str | None) -> None:
        """A worker died: raise (default), or replace it and re-send what it held."""
        w.process.join(1.0)
        exitcode = w.process.exitcode
        tasks = self._tasks_of(w)
        self._events.worker_died(w.id, w.pid, exitcode, tasks)
        if not self._policy.restart or self._iterable:
            raise self._fail(faults.died(w.id, w.pid, exitcode, tasks, self._cfg.shm_dir, iterable=self._iterable))
        self._restarts += 1
        if self._restarts > self._policy.max_restarts:
            raise self._fail(faults.budget_spent(w.id, w.pid, exitcode, tasks, self._policy.max_restarts))
        self._blame_head(w, cause or describe_exit(exitcode))
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

    def _blame_head(self, w: WorkerHandle, cause: str) -> None:
        """The task a worker was running when it died counts an attempt; too many make it poison."""
        if not w.outstanding:
            return
        rec = self._inflight.get(w.outstanding[0])
        if rec is None or w.outstanding[0][0] != self._epoch:
            return
        rec.attempts += 1
        rec.deaths.append(f"worker {w.id} (pid {w.pid}) {cause}")
        if rec.attempts >= self._policy.max_task_attempts:
            raise self._fail(faults.poison(rec.task, rec.indices, rec.attempts, rec.deaths))
