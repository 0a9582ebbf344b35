"""The worker process: fetch samples, collate them into the assigned slot, send a descriptor.

Runs in each worker process. Owns its copy of the dataset (and, for an iterable dataset, its
iterator), its mappings of the segments it was told about, and a small cache of batches that did
not fit their slot (their samples, and the batch itself where its size could not be read off the
samples). Promises:

- one reply per task, in the order tasks arrive: ``Filled``, ``TooSmall``, ``Failed`` or
  ``Exhausted``; a batch that did not fit is kept, so the retry in a larger slot neither fetches
  again nor advances an iterable dataset, and with the built-in collate it is collated once,
  straight into the larger slot (``too_small``);
- a worker whose start-up failed answers each task with that failure, in its turn
  (``worker.failed_start``), as torch's worker answers its first index with it;
- a ``Reset`` is answered with ``ResetDone`` once the iterator is restarted, before any task of
  the new epoch is read: a death before it loses no position in the stream (``serve``);
- it never registers a segment with the resource tracker and never unlinks one;
- only the worker's own process answers: a child that user code forks in it and that comes back
  into this code (no ``os._exit``) exits before it sends or reads anything (``lineage.leave_if_forked``;
  it used to answer for the worker: tests/test_procs_forked_child.py);
- it starts no task once the main process has set its stop flag (``worker.stop``), as torch's
  workers skip every queued index once ``done_event`` is set: the task running then finishes, the
  rest of its queue is dropped, and it exits;
- it exits when told (``None``), when its task pipe closes, and when the main process dies: at
  once on Linux when the thread that forked it lasts as long as its process (``PR_SET_PDEATHSIG``:
  started from the main process's main thread, or by the fork server), otherwise when its poll
  notices, within ``PARENT_CHECK_S`` of waiting for a task (``lineage``); it never blocks
  forever.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable

import numpy as np

from shmloader import worker_info
from shmloader.collate import collate, default_convert
from shmloader.collate.context import SlotFull, heap_alloc
from shmloader.collate.sizing import needed_bytes
from shmloader.log import WorkerLogSetup, apply_worker_log_setup
from shmloader.transport import codec, wire
from shmloader.transport.alloc import SlotAllocator
from shmloader.transport.messages import (
    Detach,
    Exhausted,
    Failed,
    Filled,
    Ready,
    Reset,
    ResetDone,
    SlotRef,
    Task,
    TooSmall,
)
from shmloader.transport.segment import Segment, prefault
from shmloader.worker import lineage
from shmloader.worker.failed_start import FailedStart, run_init
from shmloader.worker.failed_start import failure as _failure
from shmloader.worker.fetch import IterableFetcher, MapFetcher
from shmloader.worker.lineage import PARENT_CHECK_S
from shmloader.worker.pipes import PipeWatch
from shmloader.worker.stop import StopFlag
from shmloader.worker.task_frames import QUIET, TaskFrames


@dataclass
class WorkerSpec:
    """Everything a worker needs; cloudpickled under spawn/forkserver, inherited under fork."""

    dataset: Any
    num_workers: int
    base_seed: int
    shm_dir: str
    iterable: bool
    auto_collation: bool
    batch_size: int | None
    drop_last: bool
    collate_kind: str  # "builtin" (collate into the slot), "convert", or "user"
    collate_fn: Callable[[Any], Any] | None
    to_torch: bool
    worker_init_fn: Callable[[int], None] | None
    collate_rules: dict[type, Any] = field(default_factory=dict)
    log_setup: WorkerLogSetup | None = None  # the main process's logging (spawn/forkserver start without it)
    # (dataset, seed) at each later epoch of persistent workers whose Reset carries a seed
    reseed: Callable[[Any, int], None] | None = None


def run(spec_or_blob: WorkerSpec | bytes, worker_id: int, tasks: Connection, results: Connection,
        parent_pid: int, death_signal: bool, stop: StopFlag, nudge: Connection | None = None) -> None:
    """Process entry point (``multiprocessing.Process(target=run, ...)``).

    ``death_signal``: the thread that forked this process lasts as long as its process, so the
    kernel may kill this worker when that thread ends (``lineage.watch_parent``). ``stop``: set by
    the main process when it stops this worker; read before each message (freed already as this
    worker unpickled it: the main process has let go of it, so it exits at once). ``nudge``: the write end
    of the pool's nudge pipe (``PipeWatch.nudge``).
    """
    if stop.freed:  # the main process let go of this worker while it was starting: nothing to do, nothing to say
        os._exit(0)
    lineage.start(worker_id, parent_pid, death_signal)
    # what the pipes' descriptors name, read before any user code (the dataset's unpickling,
    # worker_init_fn) can take them: read after, a file opened onto a closed pipe's number passed
    # for the pipe, and got the Ready and every nudge (tests/test_adv6_worker_pipes_init.py)
    watch = PipeWatch(worker_id, tasks.fileno(), results.fileno(), nudge.fileno() if nudge is not None else -1)
    worker: _Worker | FailedStart
    try:
        spec = _load_spec(spec_or_blob)
        apply_worker_log_setup(spec.log_setup)  # before worker_init_fn, which may configure its own
        worker = _Worker(spec, worker_id)
    except BaseException:  # each task it is sent is answered with this, in its turn (as torch's worker)
        worker = FailedStart(_failure(0, None, sys.exc_info(), starting=True))
    else:
        watch.check_reply()
        _send(results, Ready(worker_id, os.getpid()))
    try:
        serve(worker, tasks, results, parent_pid, os.getppid(), stop.reader(), watch)
    finally:
        worker.detach_all()


def serve(worker: _Worker | FailedStart, tasks: Connection, results: Connection, main_pid: int, ppid: int,
          stopped: Callable[[bool], bool], watch: PipeWatch | None = None) -> None:
    """Serve the task pipe until told to stop: each task answered on ``results`` in turn, each
    ``Reset`` acknowledged (``ResetDone``) once the worker's iterator is restarted, before any task
    of that epoch is read. ``stopped(False)``: the stop flag, read before each message (some 50
    ns): once set, whatever is queued is dropped unread. A ``TooSmall`` is followed by a nudge
    (``PipeWatch.nudge``): the main process may be asleep on another worker's pipe. ``watch``: what
    the pipes' descriptors named as the worker started (``run``), before user code could take them;
    by default what they name now."""
    frames = TaskFrames(tasks)
    if watch is None:
        watch = PipeWatch(lineage.worker_id(), tasks.fileno(), results.fileno())

    def reply(msg: Any) -> None:
        watch.check_reply()
        _send(results, msg)
        if type(msg) is TooSmall:
            watch.nudge()

    while True:
        lineage.leave_if_forked()  # a child forked in reset()'s user code: never reads the worker's tasks
        frame = frames.next(PARENT_CHECK_S)
        if frame is QUIET:  # also a stop whose message the main process could not write (a full pipe)
            watch.check()
            if stopped(False) or os.getppid() != ppid or not lineage.alive(main_pid):
                return
            continue
        if frame is None or stopped(False):  # the task pipe closed, or the main process stops us
            watch.check()
            return
        try:
            msg = wire.decode(frame)
        except Exception:  # a task that does not unpickle here: report it, keep serving
            reply(worker.undecodable(sys.exc_info()))
            continue
        if msg is None:
            return
        if isinstance(msg, Task):
            reply(worker.handle(msg))
        elif isinstance(msg, Detach):
            worker.detach(msg.names)
        elif isinstance(msg, Reset):
            worker.reset(msg.epoch, msg.seed)
            reply(ResetDone(msg.epoch))


def run_collate(kind: str, fn: Callable[[Any], Any] | None, to_torch: bool, rules: dict, data: Any,
                alloc: Any, stack: Callable[[Any, Any], Any] | None = None) -> Any:
    """Collate one task's samples: into ``alloc`` (builtin), by conversion, or by the user's fn.

    Workers stack with one thread (``stack=None``: ``rules.stack_into``); ``num_workers=0`` passes a
    ``collate.threads.ThreadedStack``.
    """
    if kind == "builtin":
        return collate(data, alloc, to_torch=to_torch, rules=rules or None, stack=stack)
    if kind == "convert":
        return default_convert(data, to_torch=to_torch)
    if not callable(fn):  # e.g. loader.collate_fn = None after construction: torch's TypeError, named
        raise TypeError(f"collate_fn={fn!r} is not callable (None given to DataLoader() means the default "
                        "collate; set on the loader afterwards it is called like any other)")
    return fn(data)


def make_fetcher(spec: WorkerSpec, start: bool = True) -> MapFetcher | IterableFetcher:
    """The fetcher of ``spec``'s dataset; an iterable dataset's is iterated (``iter(dataset)``)
    unless ``start`` is false (``IterableFetcher.reset`` then begins it)."""
    if spec.iterable:
        return IterableFetcher(spec.dataset, spec.auto_collation, spec.batch_size, spec.drop_last, start)
    return MapFetcher(spec.dataset, spec.auto_collation)


def _load_spec(spec_or_blob: WorkerSpec | bytes) -> WorkerSpec:
    if isinstance(spec_or_blob, bytes):
        import cloudpickle

        return cloudpickle.loads(spec_or_blob)
    return spec_or_blob


def _send(conn: Connection, msg: Any) -> None:
    lineage.leave_if_forked(msg)
    try:
        wire.write_frame(conn.fileno(), wire.reply_frame(msg))
    except (BrokenPipeError, EOFError, OSError):
        os._exit(0)


class _Worker:
    def __init__(self, spec: WorkerSpec, worker_id: int) -> None:
        self.spec = spec
        self.id = worker_id
        self.segments: dict[str, tuple[Segment, np.ndarray]] = {}
        # (epoch, task) -> (data, batch, needed) of each task that answered TooSmall, kept until its
        # retry: at most the tasks this worker holds, and none of an epoch after a later one begins
        self.pending: dict[tuple[int, int], tuple[Any, Any, int]] = {}
        self.epoch = 0
        self.reset_error: Any = None  # sys.exc_info() of a failed ``reset``, for the next task's reply
        torch = sys.modules.get("torch")
        if torch is None and spec.to_torch:  # torch's flavour: seeded as torch's workers always are,
            import torch  # even when the dataset imports it only later (spawn, forkserver)
        if torch is not None:
            torch.set_num_threads(1)
        seed = worker_info.seed_worker(spec.base_seed, worker_id)
        worker_info.set_worker_info(
            worker_info.WorkerInfo(id=worker_id, num_workers=spec.num_workers, seed=seed, dataset=spec.dataset)
        )
        self.init_failure = run_init(spec.worker_init_fn, worker_id)  # its first task's answer, as torch's
        if spec.collate_kind == "builtin":  # entry-point plugins load here too (docs/plugins.md)
            from shmloader.plugins import worker_collate_rules

            spec.collate_rules = worker_collate_rules(spec.collate_rules)
        self.fetcher = make_fetcher(spec, start=False)
        if self.init_failure is None:  # else an iterable share stays ended this epoch (torch's never ends)
            self._begin_share()

    def _begin_share(self, seed: int | None = None) -> None:
        """Begin this worker's share of the epoch: ``iter(dataset)`` for an iterable dataset (after
        a DataPipe's reseed). Its error there is the share's, raised in the place of its first task;
        the share has then ended, as a generator that raised has, and the other workers' go on, as
        torch's do (a first epoch's error used to stop the whole iterator, as a failed start)."""
        self.reset_error = None
        try:
            if seed is not None and self.spec.reseed is not None:  # before the dataset is iterated again
                self.spec.reseed(self.spec.dataset, seed)
            if isinstance(self.fetcher, IterableFetcher):
                self.fetcher.reset()
        except Exception:
            if isinstance(self.fetcher, IterableFetcher):
                self.fetcher.ended = True
            self.reset_error = sys.exc_info()

    def undecodable(self, exc_info: Any) -> Failed:
        """The answer to a task that did not unpickle here: the oldest task this worker holds."""
        return _failure(self.epoch, None, exc_info)

    def reset(self, epoch: int, seed: int | None = None) -> None:
        """A persistent worker's next epoch (``_begin_share``)."""
        self.epoch = epoch
        self.pending.clear()
        self._begin_share(seed)

    # -- one task --------------------------------------------------------------------------
    def handle(self, task: Task) -> Any:
        if self.init_failure is not None:  # worker_init_fn raised: this task fails, once
            failed, self.init_failure = self.init_failure, None
            return dataclasses.replace(failed, epoch=task.epoch, task=task.task)
        if self.reset_error is not None:
            exc_info, self.reset_error = self.reset_error, None
            return _failure(task.epoch, task.task, exc_info)
        key = (task.epoch, task.task)
        try:
            if task.seed is not None:
                worker_info.seed_task(task.seed)
            t0 = time.perf_counter()
            kept = self._kept(key) if self.pending else None
            data, batch, needed = (self.fetch(task), None, 0) if kept is None else kept
            t1 = time.perf_counter()
            return self.fill(task, data, batch, t1 - t0, needed)
        except StopIteration:
            if self.spec.iterable:  # the worker's share of an iterable dataset has ended
                return Exhausted(task.epoch, task.task)
            # a map-style dataset (or a collate_fn) raised it: raised again in the main process,
            # where it ends the epoch as it does in torch, never a batch silently skipped
            return _failure(task.epoch, task.task, sys.exc_info())
        except Exception:
            return _failure(task.epoch, task.task, sys.exc_info())

    def fetch(self, task: Task) -> Any:
        if self.spec.iterable or self.spec.auto_collation:
            return self.fetcher.fetch(task.indices)
        assert task.indices is not None
        return self.fetcher.fetch(task.indices[0])

    def fill(self, task: Task, data: Any, batch: Any, fetch_s: float, needed: int = 0) -> Any:
        """Collate (or copy) the batch into the task's slot. ``needed``: on a retry, the bytes this
        batch was said to need; its slot just grew, so those pages are mapped in one call first."""
        alloc = self.allocator(task.slot)
        t0 = time.perf_counter()
        if needed:
            prefault(alloc.buf, min(needed, alloc.capacity))
        try:
            if batch is None:
                batch = self.collate(data, alloc)
            payload, nbytes = codec.encode(batch, alloc)
        except SlotFull:
            return self.too_small(task, data, batch, alloc.capacity, sized=batch is None and needed > 0)
        return Filled(task.epoch, task.task, task.slot.slot_id, payload, nbytes, fetch_s,
                      time.perf_counter() - t0, alloc.pos)

    def too_small(self, task: Task, data: Any, batch: Any, capacity: int, sized: bool) -> TooSmall:
        """The batch did not fit: keep what was fetched and say how many bytes it needs.

        The built-in collate's size is read off the samples (``collate.sizing``), so the batch is
        collated once, straight into the larger slot; only when that size is unknown — a user's
        rule or collate_fn — or ``sized``: was already tried and fell short, is the batch collated
        into ordinary memory and measured, and then copied into the slot (issue 16).
        """
        key = (task.epoch, task.task)
        spec = self.spec
        if batch is None and not sized and spec.collate_kind == "builtin":
            needed = needed_bytes(data, to_torch=spec.to_torch, rules=spec.collate_rules or None)
            if needed is not None and needed > capacity:
                self._remember(key, data, None, needed)
                return TooSmall(task.epoch, task.task, task.slot.slot_id, needed)
        if batch is None:
            batch = self.collate(data, heap_alloc)
        needed = codec.measure(batch)
        self._remember(key, data, batch, needed)
        return TooSmall(task.epoch, task.task, task.slot.slot_id, needed)

    def collate(self, data: Any, alloc: Any) -> Any:
        spec = self.spec
        return run_collate(spec.collate_kind, spec.collate_fn, spec.to_torch, spec.collate_rules, data, alloc)

    def _remember(self, key: tuple[int, int], data: Any, batch: Any, needed: int) -> None:
        """Keep a batch that did not fit (``batch`` None: not collated, its size read off the samples)
        until its retry, however many the worker holds: a retry that fetched again would advance an
        iterable dataset (a batch lost) or draw a random augmentation twice."""
        self.pending[key] = (data, batch, needed)

    def _kept(self, key: tuple[int, int]) -> tuple[Any, Any, int] | None:
        """What ``_remember`` kept for task ``key``, if anything. A task of a later epoch lets go of
        what an abandoned epoch kept: the main process sends no task of an epoch once it has sent
        one of a later one, so no retry of it can come."""
        kept = self.pending.pop(key, None)
        if kept is None:
            for stale in [k for k in self.pending if k[0] != key[0]]:
                del self.pending[stale]
        return kept

    # -- segments --------------------------------------------------------------------------
    def allocator(self, ref: SlotRef) -> SlotAllocator:
        entry = self.segments.get(ref.name)
        if entry is None:
            segment = Segment.attach(self.spec.shm_dir, ref.name, ref.size_bytes)
            entry = (segment, np.frombuffer(segment.buf, dtype=np.uint8))
            self.segments[ref.name] = entry
        segment, u8 = entry
        return SlotAllocator(segment.buf, segment.size_bytes, u8)

    def detach(self, names: tuple[str, ...]) -> None:
        """Forget retired segments; dropping the mapping and its view unmaps it."""
        for name in names:
            self.segments.pop(name, None)

    def detach_all(self) -> None:
        self.segments.clear()
