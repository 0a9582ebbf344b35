"""Dispatching tasks to workers: step 1 of the multi-process iterator.

Owns nothing of its own: a mixin of ``MultiProcessIter`` (``mp_iterator.py``), which holds the
sampler iterator, the pool, the ledger, the ring, the reorder buffer and the pure ``Dispatcher``
this step reads and changes. Runs in the main process. Promises: the pipeline holds at most
``prefetch_factor`` × workers tasks; each task gets its slot from the ledger before it is sent (so
a slot is never written by two tasks); task numbers follow the sampler, each once, and a resumed
epoch's delivered tasks are taken from the sampler but never sent, each keeping its turn in the
worker cycle; the workers hear of every retired segment before the next task is sent.
"""

from __future__ import annotations

from typing import Any

from shmloader.engine.dispatch import Dispatcher, task_indices
from shmloader.engine.ledger import Ledger, TaskRecord
from shmloader.engine.slot_size import SlotSize
from shmloader.engine.workers import WorkerHandle
from shmloader.kept import keep
from shmloader.transport.messages import Detach
from shmloader.transport.wire import task_frame
from shmloader.worker_info import task_seed


class SendTasks:
    """Step 1 of ``MultiProcessIter``: take indices from the sampler, pick a worker, send."""

    # state of MultiProcessIter that this mixin reads and changes
    _pool: Any
    _ring: Any
    _ledger: Ledger
    _reorder: Any
    _dispatcher: Dispatcher
    _sampler_iter: Any
    _sampler_done: bool
    _skip: Any
    _epoch: int
    _next_task: int
    _slot_size: SlotSize
    _iterable: bool
    _auto_collation: bool
    _base_seed: int
    _task_seeding: bool
    _full_capacity: int
    _none_exhausted: list[bool]

    def _held(self) -> list[int]:
        """How many tasks each worker holds (an abandoned epoch's included: after a kept timeout a slow
        worker is sent this epoch's tasks only as it catches up; ``MultiProcessIter._catch_up``)."""
        return [len(w.outstanding) for w in self._pool.workers]

    def _exhausted(self) -> list[bool]:
        return [w.exhausted for w in self._pool.workers]

    def _capacity(self) -> int:
        return self._dispatcher.capacity(self._exhausted())

    def _dispatch(self, spare_only: bool = False) -> None:
        """Send tasks until the pipeline is full. ``spare_only``: only into a free slot or one the
        ring may add (at ``max_slots`` the rest wait for the next ``next()``, not raise)."""
        if self._sampler_done:
            return
        in_pipeline = self._ledger.in_epoch(self._epoch) + len(self._reorder)
        if in_pipeline >= self._full_capacity:  # decided before any list is built (most calls)
            return
        if self._iterable:
            exhausted = self._exhausted()
            capacity = self._dispatcher.capacity(exhausted)
        else:
            exhausted, capacity = self._none_exhausted, self._full_capacity
        held = self._held()  # kept up to date below: built once per call, not once per task
        workers = self._pool.workers
        while in_pipeline < capacity:
            try:
                self._skip_delivered()  # first, so the worker is chosen for the task number it runs
                w = self._dispatcher.pick(self._next_task, held, exhausted)
                if w is None or (spare_only and not self._ring.has_room()):
                    return
                indices = self._next_indices()
            except StopIteration:
                self._sampler_done = True
                return
            rec = self._ledger.assign(self._epoch, self._next_task, indices, self._slot_size.bytes)
            if self._iterable:  # its seed follows the worker's own count, not timing (Dispatcher.deal)
                rec.seed_task = self._dispatcher.deal(w)
            self._next_task += 1
            self._flush_detach()
            self._send(workers[w], rec)
            held[w] += 1
            in_pipeline += 1

    def _skip_delivered(self) -> None:
        """Resume: tasks delivered before the save are taken from the sampler, never dispatched.

        Each keeps its task number (and its turn in the cycle), so the tasks that are dispatched go
        to the workers they would have gone to in an uninterrupted epoch.
        """
        while self._next_task in self._skip:
            self._read_sampler()
            self._reorder.skip(self._next_task)
            self._next_task += 1
            self._dispatcher.skip()

    _sampler_error: int | None = None  # id() of the sampler's own error, while it is raised

    def _read_sampler(self) -> Any:
        """The sampler's next item. The sampler's own error ends this epoch's reading: the tasks
        already sent are still delivered, as torch delivers them, and a sampler that would raise at
        each later read (an iterator; a generator that raised has ended) costs one error, not one
        per ``next()`` for ever. The error is marked (``sampler_error``) so that the step loop raises
        it without breaking the iterator: the sampler's fault is not the loader's."""
        try:
            return next(self._sampler_iter)
        except StopIteration:
            raise
        except Exception as exc:
            self._sampler_done = True
            self._sampler_error = id(exc)
            raise

    def sampler_error(self, exc: BaseException) -> bool:
        """Whether ``exc``, being raised, is the sampler's own error (``_read_sampler``); forgets it."""
        if self._sampler_error != id(exc):
            return False
        self._sampler_error = None
        return True

    def _next_indices(self) -> Any:
        """The task's indices: the batch sampler's batch, of its own type (a tensor, ndarray, tuple or
        range reaches ``__getitems__`` as such, as in torch's workers), the task's own copy
        (``dispatch.task_indices``); or ``[index]`` without auto-collation."""
        batch = self._read_sampler()
        if self._iterable:
            return None
        if not self._auto_collation:
            return [batch]
        return task_indices(batch)

    def _send(self, worker: WorkerHandle, rec: TaskRecord) -> None:
        rec.worker_id = worker.id
        worker.push(rec.key)
        seed = task_seed(self._base_seed, rec.epoch, rec.seed_task) if self._task_seeding else None
        slot = rec.slot
        assert slot is not None, "a task is sent only while it holds its slot"
        segment = slot.segment
        try:
            worker.send_frame(task_frame(rec.epoch, rec.task, rec.indices, slot.id, segment.name, segment.size_bytes,
                                         seed))
        except (BrokenPipeError, OSError):
            pass  # the worker is dead: its sentinel reports it and the task is handled there

    def _flush_detach(self) -> None:
        if self._ring.retired_names:
            self._pool.broadcast(Detach(tuple(self._ring.retired_names)))
            self._ring.retired_names.clear()

    _refill_error: Exception | None = None

    def _refill(self) -> None:
        try:
            self._dispatch(spare_only=True)
        except Exception as exc:
            self._refill_error = keep(exc)
