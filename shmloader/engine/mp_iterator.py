"""The multi-process iterator: dispatch tasks, wait on workers, reorder, hand out leased views.

Runs in the main process. Owns the worker pool and the slot ring of one loader (kept across
epochs with ``persistent_workers``) and one record per task in flight. A small state machine:
running → exhausted (epoch over) | broken (a fault was raised; workers and ring are shut) |
closed. Each ``__next__`` runs these steps until a batch is due:

1. ``dispatch``: while fewer than ``prefetch_factor × workers`` tasks are in the pipeline, take
   the next indices from the sampler, a free slot from the ring (growing it when the user holds
   the others) and send a task to a worker holding fewer than ``prefetch_factor``. Which worker is
   the ``dispatch`` option's: ``round_robin`` (default) is torch's, task t of the epoch to worker
   t % workers, waiting for that worker when it is full (with ``in_order=False``: torch's cycle,
   passing over a full worker), so each worker's seeded RNG streams meet the same samples as in
   torch; ``least_loaded`` sends it to the worker with the fewest outstanding. An iterable
   dataset is always dealt round-robin over the workers not yet exhausted, as torch deals it;
2. ``pop``: if the reorder buffer has the next batch due, lease its slot and decode its views;
3. ``wait``: block in ONE ``multiprocessing.connection.wait`` over every worker's reply pipe and
   process sentinel, bounded only by ``timeout=`` and the per-task hang deadline; then
   ``process`` each reply, and handle each death through ``faults`` (raise, or replace the worker
   and re-send its tasks to it).

See docs/design/slot-lifecycle.md for the ownership rules this keeps.
"""

from __future__ import annotations

import atexit
import time
import weakref
from typing import Any

from shmloader.engine import faults
from shmloader.engine.iterator import BaseIter, IterState
from shmloader.engine.reorder import Reorder
from shmloader.engine.wait import TaskRecord, WaitAndRecover
from shmloader.engine.workers import WorkerHandle, WorkerPool
from shmloader.errors import PluginError, rebuild_worker_exception
from shmloader.transport import codec
from shmloader.transport.messages import Detach, Failed, Reset, SlotRef, Task
from shmloader.transport.ring import Slot
from shmloader.transport.segment import page_round
from shmloader.worker_info import task_seed

FIRST_SLOT_BYTES = 1 << 20
_BROKEN_GRACE_S = 0.1  # how long a failed loader waits for workers to take the stop message
_live: weakref.WeakSet[MultiProcessIter] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for it in list(_live):
        it.close()


class MultiProcessIter(WaitAndRecover, BaseIter):
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
        self._epoch = self._record.epoch  # the loader's epoch number (restored on resume)
        self._slot_bytes = page_round(cfg.slot_bytes) if cfg.slot_bytes else FIRST_SLOT_BYTES
        self._ring = loader._make_ring()
        self._inflight: dict[tuple[int, int], TaskRecord] = {}
        self._pool = WorkerPool(loader._mp_context, loader._worker_spec(self._base_seed), self._num_workers)
        _live.add(self)
        try:
            if cfg.slot_bytes:
                loader._preflight(self._ring, self._slot_bytes, self._prefetch * self._num_workers + 2)
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
        # slots the user held last epoch and has let go of since are unlinked, not kept forever
        self._ring.shrink_to(self._prefetch * self._num_workers + 2)
        self._flush_detach()
        self._epoch = self._record.epoch
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
        self._shut(grace_s=None)

    def _shut(self, grace_s: float | None) -> None:
        if self._state is IterState.CLOSED:
            return
        self._state = IterState.CLOSED
        try:
            self._pool.shutdown() if grace_s is None else self._pool.shutdown(grace_s)
        finally:
            self._ring.close()
            _live.discard(self)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _fail(self, exc: BaseException) -> BaseException:
        """Shut down (briefly: a broken loader's workers may be hung) and mark broken; returns ``exc``."""
        self._shut(grace_s=_BROKEN_GRACE_S)
        self._state = IterState.BROKEN
        return exc

    # -- the step loop -------------------------------------------------------------------------
    def _next_data(self) -> Any:
        if self._state is not IterState.RUNNING:
            raise StopIteration
        started = self._started = time.monotonic()
        self._user_error: BaseException | None = None
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
        except StopIteration:
            raise
        except PluginError:
            raise  # an observer failed; the loader itself is intact
        except BaseException as exc:
            if exc is not self._user_error:  # only a user-code error in a worker leaves us usable
                self._fail(exc)
            raise

    def _finished(self) -> bool:
        return self._sampler_done and not self._current_inflight() and not len(self._reorder)

    def _end_epoch(self) -> None:
        self._state = IterState.EXHAUSTED
        self._events.epoch_end()
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
            try:
                self._skip_delivered()  # first, so the worker is chosen for the task number it runs
            except StopIteration:
                self._sampler_done = True
                return
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

    def _skip_delivered(self) -> None:
        """Resume: tasks delivered before the save are taken from the sampler, never dispatched.

        Each keeps its task number (and its turn in the ``in_order=False`` cycle), so the tasks that
        are dispatched go to the workers they would have gone to in an uninterrupted epoch.
        """
        while self._next_task in self._skip:
            next(self._sampler_iter)
            self._reorder.skip(self._next_task)
            self._next_task += 1
            self._rr = (self._rr + 1) % self._num_workers

    def _next_indices(self) -> list[Any] | None:
        batch = next(self._sampler_iter)
        if self._iterable:
            return None
        return list(batch) if self._auto_collation else [batch]

    def _pick_worker(self) -> WorkerHandle | None:
        """The worker for task ``self._next_task``, or None to wait for replies first."""
        workers = self._pool.workers
        n = len(workers)
        if not self._iterable and self._cfg.dispatch == "round_robin":
            if self._in_order:  # torch: task t to worker t % n, however busy the others are
                w = workers[self._next_task % n]
                return w if len(w.outstanding) < self._prefetch else None
            for _ in range(n):  # torch's in_order=False: the same cycle, passing over a full worker
                w = workers[self._rr % n]
                self._rr = (self._rr + 1) % n
                if len(w.outstanding) < self._prefetch:
                    return w
            return None
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
            self._user_error = self._worker_exception(msg, rec.worker_id, rec)
            raise self._user_error
        buf = self._ring.lease(rec.slot)
        batch, _views = codec.decode(msg.payload, buf, rec.slot.size_bytes)
        del buf  # the views alone keep the slot now; none at all frees it
        self._record.delivered.add(rec.task)
        self._report_batch(rec.task, rec.worker_id, msg.nbytes, msg.fetch_s, msg.collate_s,
                           time.monotonic() - self._started, len(self._reorder), len(self._inflight),
                           len(self._ring.slots))
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
