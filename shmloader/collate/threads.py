"""Split a large numpy stack over a few threads when collating in the main process (issue 16).

Owns the process's collate pool: helper threads named ``shmloader-collate-N`` that each copy one
chunk of a stack at a time, made on first use and shared by every loader of the process (as torch
shares its intra-op pool), and :class:`ThreadedStack`, the ``stack`` callable that
``SingleProcessIter`` (``num_workers=0``) passes to ``collate``. Runs in the main process only:
workers stack with one thread (``rules.stack_into``), as torch's workers do, and never reach this
module's pool.

Why: torch's in-process collate is ``torch.stack``, which copies on torch's intra-op threads;
numpy copies with one thread but releases the GIL while it does, so chunks of the samples stacked
into ``out[i:j]`` by different threads run in parallel. ``bench --workloads big --workers 0`` (16
float32[1024,1024] samples, 64 MiB a batch) went from 103 to 156–172 batches/s on a 2-core VM; the
9 MiB image batch showed no gain the spread could tell from noise, so it stays on one thread (the
threshold, and the measurements, in docs/performance.md, "Large stacks over threads").

Promises:

- a stack below ``min_bytes`` (``out.nbytes``), of one sample, or with one thread configured is
  ``stack_into`` itself: no pool is made, no thread is woken;
- otherwise the samples are cut into at most ``threads`` contiguous chunks, each stacked with
  ``stack_into`` (so the result is bit for bit the single-threaded one) by the calling thread or
  a helper, whichever claims it first; the call returns only when every chunk is done;
- an exception of any chunk is raised unchanged (of several, the earliest chunk's), so
  ``stack_checked`` reports unequal shapes as it does single-threaded; a ``KeyboardInterrupt``
  (or ``SystemExit``), of a chunk or landing while the caller waits, comes first, and is raised
  only once no helper writes into ``out`` any more;
- fork-safe: a forked child never uses the parent's pool (whose threads do not exist there:
  ``owner.ProcessOwner``); its first large stack makes a fresh one;
- the helpers are daemon threads, idle on a queue between stacks: they never delay exit.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from shmloader.collate.context import Stack
from shmloader.collate.rules import stack_into
from shmloader.owner import ProcessOwner, at_fork_in_child

__all__ = ["AUTO_THREADS_MAX", "SPLIT_MIN_BYTES", "ThreadedStack", "resolve_threads", "stack_for"]

AUTO_THREADS_MAX = 4  # collate_threads=0: this many at most; 3–4 gave no more than 2 on 2 cores
SPLIT_MIN_BYTES = 32 * 1024 * 1024  # out.nbytes from which a stack is split; see ThreadedStack


def resolve_threads(configured: int) -> int:
    """Threads a stack may use: ``configured``, or for 0 (auto) min(4, CPUs this process may use)."""
    if configured > 0:
        return configured
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        cpus = os.cpu_count() or 1
    return max(1, min(AUTO_THREADS_MAX, cpus))


def stack_for(configured: int) -> Stack:
    """The ``stack`` callable for collating in this process with ``collate_threads=configured``."""
    threads = resolve_threads(configured)
    return stack_into if threads <= 1 else ThreadedStack(threads)


class ThreadedStack:
    """``stack(batch, out)``: ``stack_into``, with stacks of at least ``min_bytes`` split over threads.

    The default threshold, 32 MiB, is where glibc stops reusing freed memory for an array and
    maps it afresh for each batch, so the copy also faults every page in: the stacks that gained
    most from a second thread on a 2-core VM (64 MiB: 9.8 → 5.8 ms). Smaller ones gained in
    isolation too, but not in the loader's rate (docs/performance.md). With the other core busy
    a split stack is a few per cent slower than one thread, as torch's stack is there.
    """

    __slots__ = ("threads", "min_bytes")

    def __init__(self, threads: int, min_bytes: int = SPLIT_MIN_BYTES) -> None:
        self.threads = threads
        self.min_bytes = min_bytes

    def __call__(self, batch: Sequence[Any], out: np.ndarray) -> np.ndarray:
        n = len(batch)
        if out.nbytes < self.min_bytes or self.threads < 2 or n < 2:
            return stack_into(batch, out)
        chunks = min(self.threads, n)
        call = _Call(batch, out, chunks)
        jobs = _shared_pool(chunks - 1).jobs
        for _ in range(chunks - 1):
            jobs.put(call)
        ran, errors = call.work()
        interrupt: BaseException | None = None
        waiting = chunks - ran
        while waiting:  # wait for every chunk a helper took: none may still write into out
            try:
                k, error = call.done.get()
            except BaseException as exc:  # a Ctrl-C in the wait: raised once the helpers are done
                interrupt = interrupt or exc
                continue
            waiting -= 1
            if error is not None:
                errors[k] = error
        for error in (interrupt, *errors.values()):
            if error is not None and not isinstance(error, Exception):
                raise error  # an interrupt (a chunk's too) before any chunk's own error
        if errors:
            raise errors[min(errors)]
        return out


class _Call:
    """One split stack: its chunks, claimed one at a time by the caller and the helpers it woke.

    A chunk no helper has claimed by the time the caller is done with its own is the caller's
    too, so a helper slow to wake (a busy machine) delays nothing; one descheduled in the middle
    of its chunk still does.
    """

    __slots__ = ("batch", "out", "bounds", "claim", "done")

    def __init__(self, batch: Sequence[Any], out: np.ndarray, chunks: int) -> None:
        n = len(batch)
        self.batch = batch
        self.out = out
        self.bounds = [n * k // chunks for k in range(chunks + 1)]
        self.claim = itertools.count()  # next() is atomic under the GIL: each chunk is claimed once
        self.done: queue.SimpleQueue[tuple[int, BaseException | None]] = queue.SimpleQueue()

    def work(self, helper: bool = False) -> tuple[int, dict[int, BaseException]]:
        """Stack chunks until none is left: (chunks run, their exceptions by chunk); a helper
        reports each chunk on ``done`` instead."""
        ran, errors, last = 0, {}, len(self.bounds) - 1
        while (k := next(self.claim)) < last:
            lo, hi = self.bounds[k], self.bounds[k + 1]
            error: BaseException | None = None
            try:
                stack_into(self.batch[lo:hi], self.out[lo:hi])
            except BaseException as exc:  # raised by the caller, once no chunk is being written
                error = exc
            if helper:
                self.done.put((k, error))
            elif error is not None:
                errors[k] = error
            ran += 1
        return ran, errors


class _Pool:
    """Helper threads serving one job queue; they belong to the process that made them."""

    __slots__ = ("owner", "jobs", "threads", "lock")

    def __init__(self) -> None:
        self.owner = ProcessOwner()
        self.jobs: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def grow(self, helpers: int) -> None:
        with self.lock:
            while len(self.threads) < helpers:
                thread = threading.Thread(target=_serve, args=(self.jobs,), daemon=True,
                                          name=f"shmloader-collate-{len(self.threads) + 1}")
                thread.start()
                self.threads.append(thread)


def _serve(jobs: queue.SimpleQueue[_Call]) -> None:
    """A helper's life: take a call, stack what is left of it, wait for the next."""
    while True:
        call = jobs.get()
        call.work(helper=True)
        del call  # hold no batch while idle


_pool: _Pool | None = None
_lock = threading.Lock()


def _shared_pool(helpers: int) -> _Pool:
    """This process's pool, with at least ``helpers`` threads; made here on first use (and in a
    forked child, whose inherited pool has no threads)."""
    global _pool
    pool = _pool
    if pool is None or not pool.owner.here:
        with _lock:
            pool = _pool
            if pool is None or not pool.owner.here:
                pool = _pool = _Pool()
    if len(pool.threads) < helpers:
        pool.grow(helpers)
    return pool


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it when the process forked


at_fork_in_child(_after_fork_in_child)  # owner.py owns the package's fork hooks
