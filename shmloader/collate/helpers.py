"""The helper threads of a split stack (``collate.threads.ThreadedStack``), and their end.

Owns each :class:`HelperPool`'s threads (``shmloader-collate-N``, daemons) and the queue they
serve, and, for the process, which pools have helpers running and which helpers were told to exit
and are not joined yet. Runs in the main process: workers stack with one thread.

Why an end: helpers made once and kept for the process's life were alive when a later loader forked
its workers. Python 3.12+ then warns that the process is multi-threaded and that fork() may
deadlock the child; it may, when a helper holds a lock (malloc's, in the middle of a copy) at the
fork. torch's DataLoader leaves no Python thread of its own alive after an epoch. So a pool
belongs to one ``num_workers=0`` iterator (through its ``ThreadedStack``), which closes it as its
epoch ends, as it is closed, or as it is collected; and every helper still alive is ended and
joined before each fork of ours (``owner.before_our_fork``). Starting a helper costs tens of
microseconds: an epoch pays it once, at its first large stack, never once a batch.

Promises:

- ``queue(n)`` starts helpers until ``n`` run (none before a pool's first use) and returns the
  queue they serve; a job put there is called once, by one helper, unless the pool stops first;
- ``stop()`` tells the running helpers to exit once their current job is done and returns them;
  a job queued after that is never called: the caller, who claims its chunks itself
  (``threads._Call``), must not wait for it. ``close()`` also joins them: none lives when it returns;
- ``join_all()`` stops every pool of the process and joins every helper told to exit (those of
  a pool collected unclosed too); a pool stopped so starts its helpers again at its next use;
- fork-safe: in a forked child an inherited pool has no helpers and makes its own on first use,
  and the parent's bookkeeping is dropped (``owner.at_fork_in_child``); never raises but what a
  thread's start or join raises (an interrupt, a thread limit).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from shmloader.owner import ProcessOwner, at_fork_in_child, before_our_fork

__all__ = ["HelperPool", "Job", "join_all"]

Job = Callable[[], object]

# Reentrant: a collection inside a locked block (a thread's allocation) may finalize another
# ThreadedStack, whose finalizer stops its pool under this same lock.
_lock = threading.RLock()
_running: set[HelperPool] = set()  # pools with helpers alive (each holds only a queue and threads)
_exiting: list[threading.Thread] = []  # helpers told to exit, not joined yet (the dead pruned at each stop)


class HelperPool:
    """Helper threads serving one job queue; they belong to the process that started them."""

    __slots__ = ("owner", "jobs", "threads")

    def __init__(self) -> None:
        self.owner = ProcessOwner()
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []

    def queue(self, helpers: int) -> queue.SimpleQueue[Job | None]:
        """The queue of this pool's helpers, with at least ``helpers`` of them running."""
        with _lock:
            if not self.owner.here:  # inherited by a fork: the parent's helpers do not exist here
                HelperPool.__init__(self)
            while len(self.threads) < helpers:
                thread = threading.Thread(target=_serve, args=(self.jobs,), daemon=True,
                                          name=f"shmloader-collate-{len(self.threads) + 1}")
                thread.start()
                self.threads.append(thread)
                _running.add(self)
            return self.jobs

    def stop(self) -> list[threading.Thread]:
        """Tell the helpers to exit after their current job (later jobs are left to the caller);
        return them. Safe from a finalizer: takes no lock a thread can hold for long."""
        with _lock:
            if not self.owner.here:
                return []
            helpers, self.threads = self.threads, []
            jobs, self.jobs = self.jobs, queue.SimpleQueue()
            _running.discard(self)
            _exiting[:] = [t for t in _exiting if t.is_alive()]  # those gone need no join: forget them
            _exiting.extend(helpers)
        for _ in helpers:
            jobs.put(None)
        return helpers

    def close(self) -> None:
        """Stop the helpers and join them."""
        _join(self.stop())


def _serve(jobs: queue.SimpleQueue[Job | None]) -> None:
    """A helper's life: run jobs until told to exit (None)."""
    while (job := jobs.get()) is not None:
        job()
        del job  # hold no batch while idle


def _join(helpers: list[threading.Thread]) -> None:
    for thread in helpers:
        thread.join()
        with _lock:
            if thread in _exiting:
                _exiting.remove(thread)


def join_all() -> None:
    """Stop every pool of this process and join every helper told to exit."""
    with _lock:
        pools = list(_running)
    for pool in pools:
        pool.stop()
    with _lock:
        helpers = list(_exiting)
    _join(helpers)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()  # a thread of the parent may have held it when the process forked
    _running.clear()  # the parent's helpers do not exist here
    _exiting.clear()


at_fork_in_child(_after_fork_in_child)  # owner.py owns the package's fork hooks
before_our_fork(join_all)  # no worker of ours is forked while a helper lives
