"""Iterators the loader hands out: the shared base and the single-process one.

Owns one epoch's position in the sampler, the base seed (drawn as torch draws it, right after the
sampler iterator is made, from ``loader.generator``), and torch's warning when an IterableDataset
yields more batches than ``len(loader)`` promised; and the epoch's ``state.EpochRecord`` (the
delivered task numbers and what re-creates the epoch), which ``state_dict()`` saves and which a
loaded state resumes: delivered tasks are skipped (map-style) or fast-forwarded (iterable); a
task whose error was raised in its place counts as delivered. See docs/resume.md. With per-task seeding, ``num_workers=0`` seeds each task as a worker would (the
caller's RNG states are put back). The multi-process iterator
(``mp_iterator.MultiProcessIter``) builds on the same base.
"""

from __future__ import annotations

import enum
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from shmloader import state as _state
from shmloader.collate.heap_pool import HeapPool
from shmloader.collate.threads import ThreadedStack, stack_for
from shmloader.engine.caller import LOADER, Caller
from shmloader.engine.pending import INTERRUPTS, UNFETCHED, UNMADE, Pending, rng_states, seeded
from shmloader.engine.plan import Plan
from shmloader.engine.stepguard import StepGuard
from shmloader.errors import LoaderClosed, PluginError, format_indices
from shmloader.kept import call_each, keep, note
from shmloader.log import logger
from shmloader.worker.main import make_fetcher, run_collate
from shmloader.worker_info import task_seed


class IterState(enum.Enum):
    RUNNING = "running"
    EXHAUSTED = "exhausted"
    BROKEN = "broken"
    CLOSED = "closed"


class BaseIter:
    """What single- and multi-process iteration share (torch's ``_BaseDataLoaderIter``).

    Reads only its ``Plan``; the loader's epoch bookkeeping is reached through ``plan.book``.
    ``caller``: who drives this epoch, as the advice of its errors names the calls (``engine.caller``).
    """

    caller: Caller = LOADER

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._dataset = plan.dataset
        self._iterable = plan.iterable
        self._auto_collation = plan.auto_collation
        self._num_workers = plan.num_workers
        self._index_sampler = plan.index_sampler
        self._base_seed = 0
        self._start_epoch(reuse_seed=None)
        self._len_called = plan.len_called
        self._state = IterState.RUNNING

    def __iter__(self) -> BaseIter:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    def _reset(self, plan: Plan) -> None:
        """The next epoch on the same iterator (persistent workers keep their base seed, as torch's)."""
        if self._observer_error is not None:  # from the epoch's last batch, and no next() came to raise it
            logger.warning("an observer failed after the last batch of the epoch (not raised: the epoch "
                           "ended first): %s", self._observer_error)
            self._observer_error = None
        self._plan = plan
        self.caller = LOADER  # until a driver of this epoch says otherwise (the device prefetcher)
        self._start_epoch(reuse_seed=self._base_seed)
        self._len_called = plan.len_called

    def _start_epoch(self, reuse_seed: int | None) -> None:
        """The sampler iterator, base seed and the record that can resume this epoch (epoch_book)."""
        # with workers the first tasks go out at iter(), as torch's do: the sampler draws there
        start = self._plan.book.start(self._index_sampler, self._iterable, reuse_seed,
                                      draw_at_iter=self._num_workers > 0)
        self._sampler_iter = start.sampler_iter
        self._base_seed = start.base_seed
        self._record = start.record
        self._next_task = 0
        self._skip = start.skip
        self._fast_forward = start.fast_forward
        self._num_yielded = self._record.yielded

    _user_error: BaseException | None = None  # the error of a batch, raised in its place

    def _batch_failed(self, task: int, error: BaseException) -> BaseException:
        """``error``, the batch's own (its dataset's, its collate's), is raised in its place: the task
        has been handed out. An uninterrupted epoch (torch's too) does not fetch it again, so it
        counts as delivered and a resume does not fetch it either; ``__next__`` counts it yielded."""
        self._user_error = error
        self._record.delivered.add(task)
        return error

    def state_dict(self) -> dict[str, Any]:
        """This epoch's state (plain, JSON-serialisable); load it with ``loader.load_state_dict``."""
        return self._plan.book.save(self._record)

    @property
    def state_of(self) -> Callable[[_state.EpochRecord], dict[str, Any]]:
        """Makes the state as of a copy of this iterator's record. It holds the epoch book, not this
        iterator: the device prefetcher keeps it for ``state_dict()`` past a ``break``, which must
        not keep this iterator's workers and slots (tests/test_leak_pending.py)."""
        return self._plan.book.save

    _observer_error: BaseException | None = None

    def _report_batch(self, task: int, *event: Any) -> None:
        """Count task ``task``'s batch handed out (delivered and yielded) and tell the observers. An
        observer's error is raised at the next ``next()``, so the batch in hand still reaches the
        caller: none is lost or skipped (docs/plugins.md). Counted first, so a state an observer
        saves has it; an interrupt in an observer (it is not handed out then) takes the count back.
        A resume's fast-forward is neither counted again nor reported: no caller gets those
        batches. ``_observe`` inlined: this runs once per batch."""
        if self._fast_forward:
            return
        record = self._record
        record.delivered.add(task)
        record.yielded += 1
        try:
            self._plan.events.batch_ready(task, *event)
        except PluginError as exc:
            if self._observer_error is None:
                self._observer_error = keep(exc)
        except BaseException:
            record.delivered.discard(task)
            record.yielded -= 1
            raise

    def _observe(self, event: Callable[..., None], *args: Any) -> None:
        """Tell the observers of an event (``Events`` method ``event``). An observer's error is kept
        and raised at the next ``next()``, so what the loader was doing (handing out a batch,
        replacing a dead worker and sending it the dead one's tasks) is finished first."""
        try:
            event(*args)
        except PluginError as exc:
            if self._observer_error is None:
                self._observer_error = keep(exc)

    def __next__(self) -> Any:
        if self._observer_error is not None:
            exc, self._observer_error = self._observer_error, None
            try:
                raise exc
            finally:
                del exc  # else its traceback holds this frame, which holds it: a cycle only the collector frees
        try:
            if self._fast_forward:
                self._forward()
            data = self._next_data()
        except StopIteration:
            self._record.finished = True
            raise
        except BaseException as exc:  # not only an Exception: a dataset's GeneratorExit too
            if exc is self._user_error:  # a batch's error, handed out in its place
                self._user_error = None  # kept, its traceback would hold this iterator in a cycle
                self._record.yielded += 1
            raise
        self._num_yielded += 1  # the record counted it as it was reported (_report_batch)
        if self._iterable and self._len_called is not None and self._num_yielded > self._len_called:
            msg = (f"Length of IterableDataset {self._dataset} was reported to be {self._len_called}"
                   f"(when accessing len(dataloader)), but {self._num_yielded} samples have been fetched. ")
            if self._num_workers > 0:
                msg += ("For multiprocessing data-loading, this could be caused by not properly configuring "
                        "the IterableDataset replica at each worker. Please see "
                        "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples.")
            warnings.warn(msg, stacklevel=2)
        return data

    def _forward(self) -> None:
        """Resume of an iterable dataset: make again and drop what was handed out before the save,
        a batch whose error was raised then included (its error is dropped with it). They are not
        reported (``_report_batch``): the saved record counted them, and the caller gets none."""
        while self._fast_forward:
            try:
                self._next_data()
            except BaseException as exc:
                if exc is not self._user_error:
                    raise
                self._user_error = None
            self._fast_forward -= 1
        self._forwarded()

    def _forwarded(self) -> None:
        """The resume's fast-forward is done (the multi-process iterator's order may change then)."""

    def _next_data(self) -> Any:
        raise NotImplementedError

    def __getstate__(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")

    def close(self) -> None:
        """Stop: a later ``next()`` raises ``LoaderClosed``."""
        self._state = IterState.CLOSED

    def _closed_error(self) -> LoaderClosed:
        return LoaderClosed(f"this {type(self).__name__} was stopped by close() (the loader's or its own): "
                            f"start a new epoch with {self.caller.epoch}")


def close_each(iterators: Iterable[BaseIter]) -> None:
    """Close every one of ``iterators`` whatever one of them raises (a ``next()`` in another thread
    that does not return in time, a pin backend's error, a Ctrl-C), then raise the first error:
    a close that gave up at the first left the others, and their workers, running."""
    call_each(list(iterators), _close)


def _close(it: BaseIter) -> None:
    it.close()


class SingleProcessIter(BaseIter):
    """``num_workers=0``: fetch and collate in the calling thread (large numpy stacks split over the
    ``collate_threads`` of ``collate.threads``, whose helpers end with the epoch), into ordinary
    memory (large arrays into buffers of the iterator's ``collate.heap_pool.HeapPool``, reused once
    no batch refers to them). An interrupt leaving ``next()`` ends the helpers too; the task it cut
    short is made again by the next ``next()``, which starts them again. The thread inside
    ``next()`` owns it until that returns (``engine.stepguard``), as it owns the multi-process one:
    ``next()`` from two threads run one after the other; one inside its own ``next()`` (an
    observer's hook, the dataset) is refused; a ``close()`` from another thread waits for it, and it
    raises ``LoaderClosed``, its batch not handed out."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        self._spec = plan.worker_spec(self._base_seed)
        self._fetcher = make_fetcher(self._spec)
        # Large numpy stacks split over a few threads, as torch.stack does here (issue 16); workers don't.
        self._stack = stack_for(plan.config.collate_threads)
        self._pool = HeapPool()  # large batch buffers, reused once nothing refers to them
        self._pending: Pending | None = None  # the task a KeyboardInterrupt/SystemExit cut short
        self._guard = StepGuard(pipe=False)  # the thread inside next() owns this iterator

    def _take_task(self) -> Pending:
        """The next task not delivered before a save, and its sampler item (StopIteration ends the epoch)."""
        while self._next_task in self._skip:  # resume: delivered before the save
            next(self._sampler_iter)
            self._next_task += 1
        index = next(self._sampler_iter)
        self._next_task += 1
        return Pending(self._next_task - 1, index)

    def _next_data(self) -> Any:
        # a next() inside this one, or in another thread, would take the task in hand and hand its batch out twice
        return self._guard.step("next()", self._step, on_stop=self._close_owned)

    def _step(self) -> Any:
        try:
            return self._fetch_next()
        except StopIteration:
            if self._state is IterState.RUNNING:
                self._state = IterState.EXHAUSTED
                self._release()
                self._record.finished = True  # before the observers: a state they save is the next epoch's start
                self._plan.events.epoch_end()
            raise
        except INTERRUPTS:  # the task stays pending; no helper waits idle for a next() that may not come
            self._stop_helpers()
            raise

    def close(self) -> None:
        """Stop; from another thread while a ``next()`` runs, once that ``next()`` has returned
        (``stepguard.CLOSE_WAIT_S`` at most); from inside it, as it returns."""
        self._guard.close(self._close_owned)

    def _close_owned(self) -> None:
        super().close()
        self._release()

    def _release(self) -> None:
        """Give up what only a running epoch needs: the batch buffers and the collate helpers."""
        self._pool.clear()
        self._stop_helpers()

    def _stop_helpers(self) -> None:
        """End and join the collate helpers; the next large stack starts them again."""
        if isinstance(self._stack, ThreadedStack):
            self._stack.close()

    def _fetch_next(self) -> Any:
        if self._state is IterState.CLOSED:
            raise self._closed_error()
        if self._state is not IterState.RUNNING:
            raise StopIteration
        pending = self._pending or self._take_task()
        # Until its batch (or its error) is handed out, the task stays pending: a Ctrl-C or
        # SystemExit in the fetch, collate, pinning copy or an observer's report leaves it for the
        # next next(), as a worker's batch is (a batch made stays made: only its report is made again).
        self._pending = pending
        if pending.batch is UNMADE:
            pending.batch, pending.times = self._make(pending)
        if self._guard.stop_requested:  # close() from another thread (or a signal handler) meanwhile
            raise self._closed_error()  # not handed out, nor counted: the iterator closes as this returns
        # worker id -1: the main process itself; all of fetch + collate is time the consumer waited
        self._report_batch(pending.task, -1, 0, *pending.times)
        self._pending = None
        return pending.batch

    def _make(self, pending: Pending) -> tuple[Any, tuple[float, float, float]]:
        """The pending task's batch, fetched, collated and (pin_memory) pinned, and its times (fetch,
        collate, both); its error is the batch's, raised in its place (``_batch_failed``), whatever
        its type but an interrupt's (``pending.INTERRUPTS``), which leaves the task pending."""
        task, spec = pending.task, self._spec
        seed = task_seed(self._base_seed, self._record.epoch, task) if self._plan.config.task_seeding else None
        t0 = time.perf_counter()
        with seeded(seed, pending, self._iterable):
            try:
                if pending.data is UNFETCHED:
                    pending.data = self._fetcher.fetch(pending.index)  # an iterable dataset may end here too
                    pending.rngs = None if seed is None else rng_states()  # a collate retry goes on from here
                t1 = time.perf_counter()
                batch = run_collate(spec.collate_kind, spec.collate_fn, spec.to_torch, spec.collate_rules,
                                    pending.data, self._pool.alloc, self._stack)
            except StopIteration:
                self._pending = None
                raise
            except INTERRUPTS:  # not the batch's error: it stays pending, made again at the next next()
                raise
            except BaseException as exc:
                self._failed(pending, exc)
                raise
        t2 = time.perf_counter()
        try:
            batch = self._plan.finish(batch)  # pinning's copy: a Ctrl-C there leaves the task pending too
        except INTERRUPTS:
            raise
        except BaseException as exc:
            self._failed(pending, exc)
            raise
        return batch, (t1 - t0, t2 - t1, t2 - t0)

    def _failed(self, pending: Pending, exc: BaseException) -> None:
        """The batch's own error (its fetch, collate or pinning copy), handed out in its place: so
        also counted yielded (an iterable dataset's resume fast-forwards by that count), with a note
        naming its batch and samples, as a worker's error names them in its message."""
        self._pending = None
        note(exc, _where(pending, self._iterable))
        self._batch_failed(pending.task, exc)


def _where(pending: Pending, iterable: bool) -> str:
    """The note on a batch's own error without workers: its batch and sample indices, as a worker's
    error names them in its message (torch's names none; the type and message stay the dataset's)."""
    samples = "of the iterable dataset" if iterable else f"(sample indices {format_indices(pending.index)})"
    return f"while loading batch {pending.task} {samples} in the main process (num_workers=0)"
