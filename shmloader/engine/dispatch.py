"""The dispatcher: which worker runs the next task, and what of its batch a task keeps. Pure: no
I/O, no processes.

Owns the round-robin cursor and the rule that picks a worker, given how many tasks each worker
holds and which workers have run out of data. Promises, with ``prefetch`` tasks at most per worker
(an iterable dataset's once a share has ended: below):

- ``round_robin`` (the default, torch's assignment): with ``in_order=True`` task t goes to worker
  t % n and, when that worker is full, nothing is sent (the caller waits for replies) — so each
  worker's seeded random streams meet the same samples as in torch; with ``in_order=False`` the
  same cycle, passing over a full worker, as torch's cycle does;
- ``least_loaded``: the worker holding the fewest tasks, ties broken from the cursor on;
- an iterable dataset is dealt round-robin over the workers not yet exhausted, as torch deals it;
  with ``in_order=True`` the next task waits for room at that worker, with ``in_order=False`` the
  cycle passes over a full worker, as torch's does (a worker slow to give its first batch does
  not stall the others);
- ``skip()`` (a task delivered before a resume) advances the cycle as a sent task would, so the
  tasks that are sent go to the workers they would have gone to in an uninterrupted epoch;
- an iterable dataset's pipeline is torch's (``_try_put_index``): ``prefetch`` × workers tasks IN
  TOTAL, less each task dealt to a worker after its share ended (``passed_over``: torch's worker
  skips it unanswered and it stays counted until the epoch ends), and a worker takes at most that
  total divided among the workers not ended (``prefetch`` while none has): the workers left read
  further ahead, the ring needing no more slots;
- ``deal(w)``: an iterable dataset's task numbers follow timing once a worker's share has ended
  (the ended worker is dealt tasks until its answer is read), so per-task seeding numbers the k-th
  task of worker w as ``k * num_workers + w`` — its task number while no share has ended — and a
  worker's batches draw the same whatever the others did.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

ROUND_ROBIN = "round_robin"
LEAST_LOADED = "least_loaded"


class Dispatcher:
    def __init__(self, num_workers: int, prefetch: int, *, mode: str = ROUND_ROBIN, in_order: bool = True,
                 iterable: bool = False) -> None:
        self.num_workers = num_workers
        self.prefetch = prefetch
        self.mode = mode
        self.in_order = in_order
        self.iterable = iterable
        self.cursor = 0
        self.dealt = [0] * num_workers  # tasks of this epoch dealt to each worker (an iterable dataset's)
        self.passed = 0  # tasks of this epoch dealt to a worker after its share ended (``passed_over``)

    def reset(self) -> None:
        """A new epoch starts its cycle at worker 0."""
        self.cursor = 0
        self.dealt = [0] * self.num_workers
        self.passed = 0

    def passed_over(self) -> None:
        """A task dealt to a worker after its share of an iterable dataset ended: it takes its place
        in the pipeline until the epoch ends, as it does in torch's count (``_tasks_outstanding``)."""
        self.passed += 1

    def deal(self, w: int) -> int:
        """Count a task of an iterable dataset dealt to worker ``w``; the number per-task seeding
        seeds it with: ``k * num_workers + w`` for the worker's k-th task of the epoch."""
        k = self.dealt[w]
        self.dealt[w] = k + 1
        return k * self.num_workers + w

    def capacity(self, exhausted: Sequence[bool]) -> int:
        """How many tasks may be in the pipeline: ``prefetch`` per worker; an iterable dataset's
        less the tasks passed over (``passed_over``), none once every share has ended."""
        if not self.iterable:
            return self.prefetch * len(exhausted)
        if all(exhausted):
            return 0
        return max(self.prefetch * len(exhausted) - self.passed, 0)

    def limit(self, exhausted: Sequence[bool]) -> int:
        """The most tasks one worker may hold: ``prefetch``; with an iterable dataset, torch's
        ``prefetch`` × workers shared among the workers whose share has not ended."""
        if not self.iterable:
            return self.prefetch
        left = sum(1 for e in exhausted if not e)
        return self.prefetch * len(exhausted) // left if left else 0

    def skip(self) -> None:
        """A task number passed over (delivered before a resume) takes its turn in the cycle."""
        self.cursor = (self.cursor + 1) % self.num_workers

    def pick(self, task: int, held: Sequence[int], exhausted: Sequence[bool]) -> int | None:
        """The worker for task number ``task``, or None to wait for replies first.

        ``held[w]``: tasks worker w holds; ``exhausted[w]``: worker w's iterable ran out.
        """
        n = len(held)
        if self.iterable:
            return self._pick_iterable(held, exhausted)
        if self.mode == ROUND_ROBIN:
            if self.in_order:  # torch: task t to worker t % n, however busy the others are
                w = task % n
                return w if held[w] < self.prefetch else None
            return self._next_with_room(held)  # torch's in_order=False: the same cycle, passing over a full worker
        w = min(((self.cursor + i) % n for i in range(n)), key=lambda i: held[i])
        return self._take(w, held)

    def _pick_iterable(self, held: Sequence[int], exhausted: Sequence[bool]) -> int | None:
        n = len(held)
        limit = self.limit(exhausted)
        if not self.in_order:  # torch's in_order=False: the cycle passes over ended and full workers
            return self._next_with_room(held, exhausted, limit)
        for _ in range(n):
            w = self.cursor % n
            if not exhausted[w]:
                return self._take(w, held, limit)
            self.cursor += 1
        return None

    def _next_with_room(self, held: Sequence[int], exhausted: Sequence[bool] | None = None,
                        limit: int | None = None) -> int | None:
        """The next worker of the cycle with room for a task (fewer than ``limit``, by default
        ``prefetch``, and, given ``exhausted``, data left), the cursor moved past it; None when
        there is none."""
        n = len(held)
        limit = self.prefetch if limit is None else limit
        for _ in range(n):
            w = self.cursor % n
            self.cursor = (self.cursor + 1) % n
            if held[w] < limit and not (exhausted is not None and exhausted[w]):
                return w
        return None

    def _take(self, w: int, held: Sequence[int], limit: int | None = None) -> int | None:
        if held[w] >= (self.prefetch if limit is None else limit):
            return None
        self.cursor = (w + 1) % len(held)
        return w


def task_indices(batch: Any) -> Any:
    """What a task keeps, and sends, of a batch sampler's batch: the batch itself where it cannot
    change (a tuple, a range), else a copy of the same type, made as the task is dispatched.

    A list or ndarray is copied (a batch sampler may refill one object for every batch, and a dead
    worker's task is sent again later, named in errors and saved for resume); a tensor is cloned
    (a view of a larger tensor, ``torch.randperm(n).split(b)``, pickles its whole storage with it);
    a one-pass iterator (a generator) becomes a list, which can be pickled and sent again.
    """
    kind = type(batch)
    if kind is list:
        return list(batch)
    if kind is tuple or kind is range:
        return batch
    if isinstance(batch, np.ndarray):
        return batch.copy()
    torch = sys.modules.get("torch")  # a tensor means torch is imported
    if torch is not None and isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, Iterator):
        return list(batch)
    return batch
