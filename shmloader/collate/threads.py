"""Split a large numpy stack over a few threads when collating in the main process (issue 16).

Owns :class:`ThreadedStack`, the ``stack`` callable that ``SingleProcessIter`` (``num_workers=0``)
passes to ``collate``, and through it a ``helpers.HelperPool``: threads named ``shmloader-collate-N``
that each copy one chunk of a stack at a time, started at the first large stack and ended by
``close()`` (the iterator's, as its epoch ends, it is closed or a Ctrl-C leaves its ``next()``) or
as the stack is collected.
Runs in the main process only: workers stack with one thread (``rules.stack_into``), as torch's
workers do, and never start helpers.

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
- the helpers live from the first large stack to ``close()`` (or the stack's collection), idle
  on a queue between stacks; a stack after ``close()`` starts them again. They are daemon threads
  (they never delay exit), and none lives when a worker of ours is forked (``helpers.join_all``);
- fork-safe: a forked child never uses the parent's helpers (they do not exist there:
  ``owner.ProcessOwner``); its first large stack starts its own.
"""

from __future__ import annotations

import itertools
import os
import queue
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from shmloader.collate.context import Stack
from shmloader.collate.helpers import HelperPool
from shmloader.collate.rules import stack_into

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
    ``min_bytes`` None: ``SPLIT_MIN_BYTES`` as the stack is made.
    """

    __slots__ = ("threads", "min_bytes", "pool", "__weakref__")

    def __init__(self, threads: int, min_bytes: int | None = None) -> None:
        self.threads = threads
        self.min_bytes = SPLIT_MIN_BYTES if min_bytes is None else min_bytes
        self.pool = HelperPool()
        weakref.finalize(self, self.pool.stop).atexit = False  # collected unclosed: its helpers exit

    def close(self) -> None:
        """End the helpers and join them (a later stack starts them again)."""
        self.pool.close()

    def __call__(self, batch: Sequence[Any], out: np.ndarray) -> np.ndarray:
        n = len(batch)
        if out.nbytes < self.min_bytes or self.threads < 2 or n < 2:
            return stack_into(batch, out)
        chunks = min(self.threads, n)
        call = _Call(batch, out, chunks)
        jobs = self.pool.queue(chunks - 1)
        for _ in range(chunks - 1):
            jobs.put(call.help)
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

    def help(self) -> None:
        """A helper's job: stack chunks until none is left, reporting each on ``done``."""
        self.work(helper=True)
