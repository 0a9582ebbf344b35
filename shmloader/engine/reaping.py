"""Reaping workers: making sure a worker process is gone, joined, and its pipes closed.

Owns the record of every worker process this process started and has not reaped
(``live_workers``: multiprocessing lists them as its children too, and a process forked from this
one must not take them for its own: ``fork_child.disown_inherited``) and the escalation that ends a
worker which does not exit on its own. Runs in the main process. Promises:

- a reaped worker starts no task from the moment its reap begins (its stop flag is set first:
  ``worker.stop``), is signalled only through its pidfd where it has one (``engine.exits``), and
  is joined, so it is never left a zombie;
- every reap is bounded: SIGTERM (with SIGCONT, for a stopped worker), a join of
  ``KILL_TIMEOUT_S``, then SIGKILL and a join of ``KILLED_JOIN_S``; a worker that even SIGKILL
  does not end in that time (uninterruptible sleep in the kernel) is named in a warning and left
  to exit when the kernel lets it; ``reap_all`` escalates all its workers together, so that bound
  holds for the pool, not for each worker (tests/test_adv3_ext_stops.py);
- both pipe ends the main process holds, its copy of the task pipe's read end and the pidfd are
  closed whatever happened, and ``reap_all`` reaps every worker even through Ctrl-C.
"""

from __future__ import annotations

import signal
import time
import weakref
from multiprocessing import process as mp_process
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from shmloader.engine import exits
from shmloader.log import logger

if TYPE_CHECKING:
    from shmloader.engine.workers import WorkerHandle

KILL_TIMEOUT_S = 1.0
# After SIGKILL: a worker in uninterruptible sleep (a read from a hung network file system) exits only
# when the kernel lets it; close() and the fault path must not wait for that for ever.
KILLED_JOIN_S = 5.0
# Every worker process this process started and has not reaped.
live_workers: weakref.WeakSet[Any] = weakref.WeakSet()


def reap_all(workers: list[WorkerHandle]) -> None:
    """Reap every worker, even through KeyboardInterrupts (re-raised once all are joined): an
    interrupted reap would leave a worker running that nothing knows of any more. The workers are
    escalated together (``escalate``), so the bound is one escalation, not one per worker: one
    after another, each worker that ignores SIGTERM (a handler of the dataset's) cost
    ``KILL_TIMEOUT_S`` more."""
    interrupt: BaseException | None = None
    escalated = False
    try:
        escalate(workers)
        escalated = True
    except KeyboardInterrupt as exc:
        interrupt = exc
    for w in workers:
        while True:
            try:
                reap(w, escalated)
                break
            except KeyboardInterrupt as exc:
                interrupt = interrupt or exc
        logger.info("worker %d exited (pid %s, exit code %s)", w.id, w.pid, w.process.exitcode)
    if interrupt is not None:
        try:
            raise interrupt
        finally:
            del interrupt  # else its traceback holds this frame, which holds it: a cycle only the collector frees


def reap(w: WorkerHandle, escalated: bool = False) -> None:
    """Make sure the process is gone and joined, and close its pipes. Bounded: a worker that even
    SIGKILL does not end within ``KILLED_JOIN_S`` is named in a warning and left to exit when the
    kernel lets it (multiprocessing reaps it then); its pipes are closed all the same.
    ``escalated``: ``escalate`` has already run for this worker (``reap_all``)."""
    if not escalated:
        escalate([w])  # sets the stop flag first: a worker that outlives SIGTERM starts no task meanwhile
    p = w.process
    if not w.running:
        p.join()  # reaps it (at once: it has exited); a no-op where SIGCHLD is ignored
        if p.exitcode is None and isinstance(getattr(mp_process, "_children", None), set):
            mp_process._children.discard(p)  # type: ignore[attr-defined]  # else its exit handler signals the pid
    w.unsent.clear()  # nobody will read it now
    w.backlog.discard(w)
    live_workers.discard(p)
    pidfd, w.pidfd = w.pidfd, -1
    exits.close(pidfd)
    close_pipes(w.tasks, w.results, w.task_reader)


def escalate(workers: list[WorkerHandle]) -> None:
    """End every worker still running: SIGTERM (with SIGCONT: a stopped worker acts on SIGTERM only
    once continued) to all of them, one shared join of ``KILL_TIMEOUT_S``, then SIGKILL to those
    left and one shared join of ``KILLED_JOIN_S``; each that even SIGKILL does not end is named in
    a warning. Every stop flag is set first."""
    for w in workers:
        if w.stop is not None:
            w.stop.set()
    _signal_and_join([w for w in workers if w.running], (signal.SIGTERM, signal.SIGCONT), KILL_TIMEOUT_S)
    killed = [w for w in workers if w.running]
    _signal_and_join(killed, (signal.SIGKILL,), KILLED_JOIN_S)
    for w in killed:
        _warn_if_running(w)


def _signal_and_join(workers: list[WorkerHandle], signals: tuple[int, ...], timeout_s: float) -> None:
    """Send ``signals`` to every worker, then join them against one deadline ``timeout_s`` away."""
    for w in workers:
        for sig in signals:
            w.signal(sig)
    deadline = time.monotonic() + timeout_s
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))


def join_killed(w: WorkerHandle) -> None:
    """Join a worker just sent SIGKILL, for at most ``KILLED_JOIN_S``; warn if it is still there."""
    w.join(KILLED_JOIN_S)
    _warn_if_running(w)


def _warn_if_running(w: WorkerHandle) -> None:
    if w.running:
        logger.warning("worker %d (pid %s) did not exit within %s s of SIGKILL (uninterruptible sleep in the "
                       "kernel: a hung network file system or device?); not waiting for it any longer",
                       w.id, w.pid, KILLED_JOIN_S)


def close_pipes(*conns: Connection | None) -> None:
    """Close each connection given (None: none), ignoring one already closed or gone bad."""
    for conn in conns:
        if conn is None:
            continue
        try:
            conn.close()
        except OSError:
            pass
