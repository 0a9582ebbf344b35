"""The multi-process iterator: dispatch tasks, wait on workers, reorder, hand out leased views.

Runs in the main process. Owns the worker pool and the ledger (and through it the slot ring) of
one loader — kept across epochs with ``persistent_workers`` — and nothing of the loader's: it is
built from a frozen ``Plan``. A small state machine: running → exhausted (epoch over) | broken (a
fault was raised; workers and ring are shut; a later ``next()`` raises ``LoaderError`` naming it,
never a quiet end of the epoch) | closed (``close()``: a later ``next()`` raises
``LoaderClosed``). Each ``__next__`` runs these steps until a batch is due:

1. ``dispatch`` (``engine.send``): while fewer than ``prefetch_factor`` × workers tasks are in the pipeline, take the
   next indices from the sampler, let the ``Dispatcher`` pick the worker (torch's round-robin by
   default) and the ``Ledger`` give the task a free slot (the ring grows when the user holds the
   others), and send the task. As in torch, ``iter()`` fills the pipeline and each batch handed out
   is first replaced by the next task, so the sampler is read exactly as far ahead as torch reads it;
2. ``pop``: if the reorder buffer has the next task due, the ledger leases its slot to the user and
   the codec makes the views;
3. ``wait`` (``engine.wait``): ONE poll (as ``multiprocessing.connection.wait``) over every worker's reply
   pipe and process sentinel; process each reply; recover from each death through ``faults``.
   While slots too small for their batch grow (``engine.growth``), their bytes are reserved first,
   until a reply waits (``grow``).

Every slot transition goes through the ledger, which names the task, so a slot is never freed or
re-assigned by a party that does not hold it (docs/design/ownership.md). One thread at a time runs
these steps, and owns the iterator while it does (``engine.stepguard``): a ``close()`` from another
thread wakes it and waits for it to return before anything is shut.
"""

from __future__ import annotations

import functools
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

from shmloader.engine import faults, live
from shmloader.engine.dispatch import ROUND_ROBIN, Dispatcher
from shmloader.engine.growth import Growths, Refused
from shmloader.engine.iterator import BaseIter, IterState
from shmloader.engine.ledger import Ledger, TaskRecord
from shmloader.engine.plan import Plan
from shmloader.engine.reorder import Reorder
from shmloader.engine.send import SendTasks
from shmloader.engine.slot_size import SlotSize
from shmloader.engine.stepguard import StepGuard
from shmloader.engine.wait import WaitAndRecover
from shmloader.engine.workers import WorkerPool
from shmloader.errors import (
    DescriptorError,
    LoaderClosed,
    LoaderError,
    PluginError,
    WorkerTimeout,
    batch_rebuild_error,
)
from shmloader.owner import ProcessOwner
from shmloader.transport import codec
from shmloader.transport.messages import Failed, Reset
from shmloader.transport.preflight import ring_slots
from shmloader.transport.segment import page_round

FIRST_SLOT_BYTES = 1 << 20
_BROKEN_GRACE_S = 0.1  # how long a failed loader waits for workers to take the stop message


class MultiProcessIter(SendTasks, WaitAndRecover, BaseIter):
    _shut_done = False  # workers stopped and ring unlinked (end of a non-persistent epoch, a fault, close)

    def __init__(self, plan: Plan, admit: Callable[[BaseIter], None]) -> None:
        """Build and start; ``admit`` (``LiveIterators.admit``) records it first, or refuses it."""
        self._creator = ProcessOwner()
        self._guard = StepGuard()  # the thread inside next() owns this iterator (engine/stepguard.py)
        # so does the one building it: a close() from another thread waits for the build (on_stop)
        self._guard.step("iter(loader)", functools.partial(self._construct, plan, admit), on_stop=self._close_owned)

    def _construct(self, plan: Plan, admit: Callable[[BaseIter], None]) -> None:
        try:
            admit(self)  # before anything starts: a close() since iter(loader) began refuses it here
            self._build(plan)
            for w in self._pool.workers:
                self._observe(plan.events.worker_started, w.id, w.pid)  # an observer's error: at the first next()
            self._begin_epoch()
            self._dispatch(spare_only=True)  # torch's iter() sends prefetch_factor tasks per worker at once
        except BaseException:  # the sampler, the ring, a worker's start, a Ctrl-C: what was made goes
            self._close_owned()  # close() would only leave a request: this thread holds the step lock
            raise

    def _build(self, plan: Plan) -> None:
        """Everything the iterator owns after its step guard: sampler, ring, ledger, workers (started)."""
        super().__init__(plan)
        cfg = plan.config
        self._prefetch = plan.prefetch_factor
        self._policy = faults.FaultPolicy(cfg.on_worker_death, cfg.max_restarts, cfg.max_task_attempts,
                                          cfg.task_timeout_s)
        self._dispatcher = Dispatcher(self._num_workers, self._prefetch, mode=cfg.dispatch, in_order=plan.in_order,
                                      iterable=self._iterable)
        self._slot_size = SlotSize(page_round(cfg.slot_bytes) if cfg.slot_bytes else FIRST_SLOT_BYTES,
                                   ring_slots(self._num_workers, self._prefetch))
        self._none_exhausted = [False] * self._num_workers  # a map-style dataset's workers never run out
        self._full_capacity = self._dispatcher.capacity(self._none_exhausted)
        self._task_seeding = cfg.task_seeding
        # the wait reads only the due batch's worker where no other reply could be used (wait.py)
        self._head_only = (plan.in_order and cfg.dispatch == ROUND_ROBIN and not self._iterable
                           and cfg.task_timeout_s <= 0)
        self._start_failures: dict[int, int] = {}
        self._deadlined = plan.timeout_s > 0 or cfg.task_timeout_s > 0  # else the wait has no timeout to compute
        self._ring = plan.make_ring()
        self._ring.whole_slots = ring_slots(self._num_workers, self._prefetch)  # held batches past it are trimmed
        self._ledger = Ledger(self._ring)
        self._growths = Growths(self._ledger)
        self._pool = WorkerPool(plan.context, plan.worker_spec(self._base_seed), self._num_workers,
                                warning_module=plan.warning_module)
        live.IN_PROCESS.add(self)
        if cfg.slot_bytes:
            plan.preflight(self._ring, self._slot_size.bytes, ring_slots(self._num_workers, self._prefetch), given=True)
        self._pool.start_all()

    # -- epoch life cycle ----------------------------------------------------------------------
    def _begin_epoch(self) -> None:
        self._epoch = self._record.epoch  # the loader's epoch number (restored on resume)
        # a resumed iterable epoch replays the saved (in-order) epoch's first batches: dealt and
        # handed out in order until its fast-forward is done, whatever in_order says (_forwarded)
        ordered = self._plan.in_order or self._fast_forward > 0
        self._reorder: Reorder[tuple[TaskRecord, Any]] = Reorder(ordered)
        self._dispatcher.in_order = ordered
        self._sampler_done = False
        self._restarts = 0
        self._unbegun = set()  # before any Reset of the epoch: none (deaths.py)
        self._dispatcher.reset()
        self._state = IterState.RUNNING

    def _forwarded(self) -> None:
        """The fast-forward is done: with ``in_order=False`` the rest of the epoch is dealt and
        handed out as torch's unordered loader does (a worker slow to answer is passed over)."""
        if not self._plan.in_order:
            self._reorder.arrival_order()
            self._dispatcher.in_order = False

    def _reset(self, plan: Plan) -> None:
        """Next epoch on the same workers (persistent_workers); an abandoned epoch is reclaimed.
        Waits for a ``next()`` running in another thread to return first."""
        if not self._creator.here:
            raise self._foreign_error("iter(loader)")
        self._guard.step("iter(loader)", functools.partial(self._reset_owned, plan))

    def _reset_owned(self, plan: Plan) -> None:
        if self._state is IterState.CLOSED:
            raise self._closed_error()
        super()._reset(plan)
        for rec, _msg in self._reorder.drain():
            self._ledger.drop(rec)  # a failed task already gave its slot back: drop is then a no-op
        for rec in self._growths.abandon():  # held by no worker: nothing else would give their slots back
            self._ledger.release(rec)
        # slots the user held last epoch and has let go of since are unlinked, not kept forever
        self._ring.shrink_to(ring_slots(self._num_workers, self._prefetch))
        self._flush_detach()
        self._begin_epoch()
        try:
            self._replace_dead_between_epochs()  # before the epoch begins for any worker: they held none of it
            self._catch_up()
            if self._iterable:
                self._pool.broadcast(Reset(self._record.epoch, plan.reset_seed))
                self._unbegun = {w.id for w in self._pool.workers}  # until each one's ResetDone
                for w in self._pool.workers:
                    w.exhausted = False
            self._dispatch(spare_only=True)
        except BaseException:
            # a successor that could not start, the sampler or a Ctrl-C stopped the epoch as it began;
            # the epoch book forgets that epoch (EpochBook.starting), so the next one has its number and
            # tasks sent would answer for its own: the iterator goes, as a failed first iter() does
            self._close_owned()
            raise

    def _catch_up(self) -> None:
        """Before a persistent iterator's next epoch is sent: wait until the workers have answered every
        task of the abandoned epoch (left by a ``break``), their batches dropped as they come, as
        torch's ``iter()`` waits for them (``_reset``) before it sends ``prefetch_factor`` tasks per
        worker, reading the sampler that far (tests/test_parity_train_persistent_break.py). The new
        epoch's tasks would run after those anyway (a worker runs its tasks in order), so the first
        batch comes no later, and the ring needs no slots beyond its steady size for them
        (tests/test_reset_window.py). ``timeout=`` bounds the wait, as torch's: past it (the workers
        kept) the epoch starts on them, a slow worker sent its share only as it catches up
        (``SendTasks._held``), and ``next()`` waits for its batch again (docs/reliability.md, "Hangs")."""
        started = time.monotonic()
        self._between_epochs = True  # a worker that dies now has read nothing of the new epoch (deaths.py)
        try:
            while any(key[0] != self._epoch for w in self._pool.workers for key in w.outstanding):
                self._wait(started)
        except WorkerTimeout:
            if self._state is IterState.BROKEN:  # a hung task killed without the restart policy
                raise
            # timeout= with the workers kept: the epoch starts on them (docs/reliability.md, "Hangs"),
            # the slow worker sent nothing of it until it catches up (SendTasks._held)
        finally:
            self._between_epochs = False

    @property
    def closed(self) -> bool:
        """True once the workers are stopped and the ring is unlinked."""
        return self._shut_done

    def close(self) -> None:
        """Stop every worker and unlink every segment (views the user holds stay valid); a later
        ``next()`` raises ``LoaderClosed``. A no-op in a process that inherited this iterator.

        From another thread while a ``next()`` runs: that ``next()`` is woken and raises
        ``LoaderClosed``, and this call returns once it has (at most ``stepguard.CLOSE_WAIT_S``).
        From inside that ``next()`` (a plugin hook): the iterator closes as that ``next()`` returns.
        """
        if not self._creator.here:
            return
        self._guard.close(self._close_owned)  # from inside our own next(): it closes as it returns

    def _close_owned(self) -> None:
        self._state = IterState.CLOSED  # first: a Ctrl-C in the shutdown leaves it closed, not running
        self._shut(grace_s=None)

    def _shut(self, grace_s: float | None) -> None:
        if self._shut_done:
            return
        self._shut_done = True
        # what a constructor that failed part-way did not make yet is not there to shut
        plan, pool, ring = (self.__dict__.get(name) for name in ("_plan", "_pool", "_ring"))
        if plan is not None:
            plan.book.reused_seed = None
        try:
            if pool is not None:
                pool.shutdown() if grace_s is None else pool.shutdown(grace_s)
        finally:
            try:
                if ring is not None:
                    ring.close()
            finally:
                self._drop_poll_set()
                self._guard.close_pipe()
                live.IN_PROCESS.discard(self)

    # torch's private names, for code written against torch's iterator (its own test suite,
    # teardown helpers): the workers' processes, and the shutdown that close() is here
    @property
    def _workers(self) -> list[Any]:
        """The workers' ``multiprocessing`` process objects, as torch's ``_workers`` lists them."""
        pool = self.__dict__.get("_pool")
        return [w.process for w in pool.workers] if pool is not None else []

    def _shutdown_workers(self) -> None:
        """torch's name for stopping the workers: :meth:`close`."""
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _foreign_error(self, call: str) -> LoaderError:
        """A process forked off the one that made this iterator may not use it: its workers, pipes
        and slots are the creator's (docs/design/ownership.md)."""
        return LoaderError(f"{call} on a loader iterator made by process {self._creator.pid}, in process "
                           f"{os.getpid()} (forked from it): its workers and slots belong to that process. "
                           "Make a new DataLoader (or iterator) in this process.")

    _broken_by = "an error"  # faults.first_line of the fault that broke the iterator (_fail)

    def _fail(self, exc: BaseException) -> BaseException:
        """Shut down (briefly: a broken loader's workers may be hung) and mark broken; returns ``exc``.
        A later ``next()`` raises an error that names it (``faults.stopped_after``)."""
        self._broken_by = faults.first_line(exc)
        self._state = IterState.BROKEN  # first: a Ctrl-C in the shutdown leaves it broken, not running
        self._shut(grace_s=_BROKEN_GRACE_S)
        return exc

    # -- the step loop -------------------------------------------------------------------------
    def _next_data(self) -> Any:
        if not self._creator.here:
            raise self._foreign_error("next()")
        # close() from a hook while this next() ran: this next() closes the iterator as it returns
        try:
            return self._guard.step("next()", self._step, on_stop=self._close_owned)
        except LoaderClosed:
            live.park_if_exiting()  # a thread other than the main one stopped by the exit hook: no traceback at exit
            raise

    def _step(self) -> Any:
        if self._state is IterState.CLOSED:
            raise self._closed_error()
        if self._state is not IterState.RUNNING:
            if self._state is IterState.BROKEN:  # its batches died with its workers: never a quiet end
                raise faults.stopped_after(type(self).__name__, self._broken_by, self.caller)
            raise StopIteration
        started = self._started = time.monotonic()
        self._user_error: BaseException | None = None
        guard = self._guard
        try:
            if self._refill_error is not None:  # raised as the last batch was handed out: now its turn
                error, self._refill_error = self._refill_error, None
                try:
                    raise error
                finally:
                    del error  # else its traceback holds this frame, which holds it: a cycle only the collector frees
            while True:
                if guard.stop_requested:  # close() from another thread: it waits for us to return
                    raise self._closed_error()
                self._dispatch()
                item = self._reorder.pop()
                if item is not None:
                    return self._hand_out(*item)
                if self._finished():
                    self._end_epoch()
                    raise StopIteration
                if self._growths.waiting:
                    self._grow()  # slots too small for their batch grow while nothing is due
                    if self._reorder.has_due():
                        continue  # a growth refused there is its task's outcome, maybe due now: no wait
                self._wait(started)
        except (StopIteration, LoaderClosed):
            raise  # the epoch's end; or close(), which shuts down cleanly as next() returns
        except PluginError:
            raise  # an observer failed; the loader itself is intact
        except BaseException as exc:
            if isinstance(exc, WorkerTimeout) and self._plan.persistent:
                raise  # timeout= with persistent workers: they are kept, the epoch runs on (wait._on_quiet)
            # only a user-code error (a worker's, the sampler's) leaves us usable
            if exc is not self._user_error and not self.sampler_error(exc):
                self._fail(exc)
            raise

    def _finished(self) -> bool:
        return self._sampler_done and not self._ledger.in_epoch(self._epoch) and not len(self._reorder)

    def _end_epoch(self) -> None:
        self._state = IterState.EXHAUSTED
        self._record.finished = True  # before the observers: a state they save is the next epoch's start
        if self._plan.persistent:
            self._plan.book.reused_seed = self._base_seed  # the next epoch reuses it, as torch's does
        try:
            self._plan.events.epoch_end()  # an observer's error is raised in place of StopIteration...
        finally:  # ...once the epoch's end is done
            if not self._plan.persistent:
                self._shut(grace_s=None)

    # -- 2. deliver ----------------------------------------------------------------------------
    def _hand_out(self, rec: TaskRecord, msg: Any) -> Any:
        """The due batch (or its error), after which, as torch's iterator does, the next task is
        sent, so ``prefetch_factor`` tasks per worker stay in flight while the caller uses the batch.
        An error in that send (the sampler's own) is raised at the next ``next()``: the batch
        taken out of its slot reaches the caller first (tests/test_parity_prefetch.py)."""
        try:
            batch = self._deliver(rec, msg)
        except BaseException as exc:
            if exc is self._user_error:
                self._refill()
            raise
        self._refill()
        return batch

    def _deliver(self, rec: TaskRecord, msg: Any) -> Any:
        if isinstance(msg, Refused):  # its slot could not grow: the loader breaks now that the task is due
            error = msg.take()
            try:
                raise error
            finally:
                del error  # else this frame, in the error's traceback, holds it: a cycle only the collector frees
        if isinstance(msg, Failed):
            if msg.starting:  # the worker could not start: none of its tasks will be done, the iterator stops
                raise self._worker_exception(msg, rec.worker_id, None)  # named as torch names it: no task
            # worker_init_fn's error (msg.init) is named as torch names it: no task, whose batch it is all the same
            raise self._batch_failed(rec.task, self._worker_exception(msg, rec.worker_id, None if msg.init else rec))
        size = rec.slot.size_bytes if rec.slot is not None else 0
        buf = self._ledger.deliver(rec)
        try:
            batch, _views = codec.decode(msg.payload, buf, size)
        except DescriptorError:
            raise  # a descriptor that fails validation: the engine's fault, the loader is broken
        except Exception as exc:  # the batch's own objects do not unpickle here: a data error, as a worker's
            del buf
            traceback.clear_frames(exc.__traceback__)  # the half-made views go now: the slot is free again
            raise self._batch_failed(rec.task, batch_rebuild_error(
                exc, worker_id=rec.worker_id, pid=self._worker_pid(rec.worker_id), task=rec.task,
                indices=rec.indices)) from exc
        del buf  # the views alone keep the slot now; none at all frees it
        try:  # pinning's copy, before the batch counts as handed out: an interrupt there leaves it undelivered
            batch = self._plan.finish(batch)
        except Exception as exc:  # the copy's own error: the batch's, raised in its place (as without workers)
            raise self._batch_failed(rec.task, exc)
        self._report_batch(rec.task, rec.worker_id, msg.nbytes, msg.fetch_s, msg.collate_s,
                           time.monotonic() - self._started, len(self._reorder), len(self._ledger),
                           len(self._ring.slots))
        return batch

    def _worker_pid(self, worker_id: int) -> int | None:
        return self._pool.workers[worker_id].pid if worker_id < len(self._pool.workers) else None

    def _worker_exception(self, msg: Failed, worker_id: int, rec: TaskRecord | None) -> BaseException:
        return faults.worker_exception(msg, worker_id, self._worker_pid(worker_id), rec)
