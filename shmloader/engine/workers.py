"""Worker processes as the main process sees them: start, message, replace, stop.

Owns each worker's process and its two one-way pipes (tasks out, replies in; no
``multiprocessing.Queue`` and so no feeder threads) and the FIFO of tasks each worker holds.
Runs in the main process. Promises: ``shutdown`` leaves no process (stop flag and message, bounded
join, then SIGTERM, then SIGKILL: ``engine.reaping``) and no open pipe, and reaps every child it
started, so none is left a zombie; once it begins, no worker starts a task (``worker.stop``); a
worker is started the same way the first time and on a restart (same id, same seed, its own clear
stop flag, ``worker_init_fn`` re-run). A handle knows whether its worker has finished starting
(``ready``), so a death during start-up is not blamed on the task that waited for it.

A pool that fails part-way through ``start_all`` (EMFILE, a fork refused at the pid limit, Ctrl-C)
is torn down by the same ``shutdown`` as a whole one: ``_start`` itself puts each worker in
``workers`` as soon as its ``start()`` returns, still inside the ``try`` whose handler reaps it (if
it got as far as existing) and closes its pipes (issue 15). A Ctrl-C that lands once the process
runs (Python raises it right after a C call returns) used to fall after that ``try`` and before
``start_all`` or ``replace`` recorded the handle, and left a worker that no ``shutdown`` knew of
(tests/test_interrupt_windows.py).

Any thread may start a worker (``iter(loader)``, ``next()`` and so ``replace``, in a thread of the
user's). A worker outlives the thread that started it; it dies with the main process: at once
(``PR_SET_PDEATHSIG``) when started from the main thread or by the fork server, otherwise through
its own poll of the main process (``worker.lineage.watch_parent``). A process forked from this one
by other code does not inherit our workers as its children (``engine.fork_child``), so its exit
leaves them alone.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

from shmloader.log import logger
from shmloader import owner
from shmloader.engine import exits, fork_child, start_limits  # fork_child: its at-fork hook, registered on import
from shmloader.engine.payload import pickled_spec, warn_if_unpicklable
from shmloader.engine.reaping import close_pipes, live_workers, reap, reap_all
from shmloader.transport import wire
from shmloader.worker import main as worker_main
from shmloader.worker.stop import StopFlag

# torch joins each worker for MP_STATUS_CHECK_INTERVAL (5 s) before it terminates it: a worker on its
# way out runs its cleanup (finalizers, a spawned interpreter's teardown, a second with torch imported)
_JOIN_TIMEOUT_S = 5.0


@dataclass(eq=False)
class WorkerHandle:
    """One live worker: its process, pipes, the tasks it holds (oldest first) and its outbox.

    The task pipe's write end is non-blocking: a message is written as far as the pipe takes it
    and the rest waits in ``unsent``, in order, with the handle in ``backlog`` (its pool's set of
    handles with bytes to write) until ``flush`` has written it all. A worker reads its task pipe
    only between tasks, so a task larger than the pipe (some 40,000 indices, or a few hundred file
    paths) must not hold the main process up: ``timeout=``, the per-task deadline and ``close()``
    act while it waits to be written."""

    id: int
    process: Any
    tasks: Connection
    results: Connection
    outstanding: deque[tuple[int, int]] = field(default_factory=deque)  # (epoch, task)
    head_since: float = 0.0  # when the oldest outstanding task became the one it works on
    exhausted: bool = False
    ready: bool = False  # the worker said Ready: dataset loaded, seeded, worker_init_fn done
    backlog: set[WorkerHandle] = field(default_factory=set)  # the pool's handles with bytes unsent
    unsent: bytearray = field(default_factory=bytearray)  # framed messages the pipe has not taken yet
    replies: wire.FrameReader = field(init=False)  # every reply waiting on ``results``, one read (issue 16)
    # The main process's copy of the task pipe's read end, never read: while it is open a task
    # written to a worker that just died lands in the pipe instead of raising SIGPIPE, which kills
    # a process whose SIGPIPE action is the default (tests/test_sigpipe.py); the sentinel reports
    # the death. Closed with the handle (``reaping.reap``).
    task_reader: Connection | None = None
    # A pidfd of the process (fork, spawn; -1 where none): its exit, which the worker's own children
    # cannot hide as they can its sentinel (engine/exits.py). Closed with the handle (``reaping.reap``).
    pidfd: int = -1
    # Set when the main process stops this worker (shutdown, a reap): it then starts no task (worker/stop.py)
    stop: StopFlag | None = None
    # Under forkserver, the pid of the fork server that started it (0 otherwise): its exit status dies
    # with that server (exits.fork_server_gone), and a death is then reported as unknown
    fork_server: int = 0
    # Told to exit (its stop flag set, then ``None``): an iterable worker whose share of a
    # non-persistent epoch had ended, as torch's is told once its end is read (engine/deaths.py)
    leaving: bool = False
    # Dead and reaped, kept in its place without a successor (``WorkerPool.retire``): an iterable
    # worker whose share of a non-persistent epoch had ended. Never polled, never dealt a task.
    retired: bool = False

    def __post_init__(self) -> None:
        self.replies = wire.FrameReader(self.results.fileno())
        os.set_blocking(self.tasks.fileno(), False)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exit_fd(self) -> int:
        """What the wait polls for this worker's exit: its pidfd, else its sentinel."""
        return self.pidfd if self.pidfd >= 0 else self.process.sentinel

    def join(self, timeout_s: float | None) -> None:
        """Join the process, over as soon as it has exited (``exits.join``)."""
        exits.join(self.process, self.pidfd, timeout_s)

    @property
    def running(self) -> bool:
        """Not yet exited: no exit code, and its pidfd (if any) says so too (a trainer that ignores
        SIGCHLD never gets an exit code: engine/exits.py)."""
        return self.process.exitcode is None and not exits.exited(self.pidfd)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to this worker and to no other process (``exits.send_signal``)."""
        exits.send_signal(self.process, self.pidfd, sig)

    def send(self, msg: Any) -> None:
        """Send any picklable message (stop, ``Detach``, ``Reset``), behind every task already sent."""
        self.send_frame(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))

    def send_frame(self, payload: bytes) -> None:
        """Send an encoded message (``wire.task_frame``): one write, never blocking; what the pipe
        does not take waits in the outbox. ``OSError`` once the pipe is closed or the worker gone."""
        data = wire.frame(payload)
        if self.unsent:
            self.unsent += data
            self.flush()
            return
        written = wire.write_some(self.tasks.fileno(), data)  # fileno(): OSError once the pipe is closed
        if written < len(data):
            self.unsent += memoryview(data)[written:]
            self.backlog.add(self)

    def flush(self) -> bool:
        """Write what the pipe takes now of the outbox; True once it is empty. On ``OSError`` (the
        worker is gone) the outbox is dropped, and the error raised: its sentinel tells the rest."""
        try:
            written = wire.write_some(self.tasks.fileno(), self.unsent) if self.unsent else 0
        except OSError:
            self.unsent.clear()
            self.backlog.discard(self)
            raise
        del self.unsent[:written]
        if self.unsent:
            self.backlog.add(self)
            return False
        self.backlog.discard(self)
        return True

    def read_replies(self) -> list[Any]:
        """Every whole reply waiting on ``results``, decoded, in order (one read: call it when the
        pipe polls readable). ``EOFError`` once the worker's end is closed and none is left."""
        return [wire.decode(frame) for frame in self.replies.read()]

    def push(self, key: tuple[int, int]) -> None:
        if not self.outstanding:
            self.head_since = time.monotonic()
        self.outstanding.append(key)

    def pop(self, key: tuple[int, int]) -> None:
        try:
            self.outstanding.remove(key)
        except ValueError:
            return
        self.head_since = time.monotonic()


class WorkerPool:
    """Starts and stops the workers of one iterator (or of a loader, with persistent workers)."""

    def __init__(self, ctx: BaseContext, spec: worker_main.WorkerSpec, num_workers: int, *,
                 warning_module: str | None = None) -> None:
        self.ctx = ctx
        self.num_workers = num_workers
        self._warning_module = warning_module  # the torch flavour's, for torch's pickle warning (payload.py)
        method = ctx.get_start_method()
        self._fork = method == "fork"
        self._forkserver = method == "forkserver"
        # under fork a worker inherits the spec; otherwise it is pickled once here, for every start
        try:
            self._payload: Any = spec if self._fork else pickled_spec(spec, method)  # bytes, or the spec (payload.py)
        except Exception as exc:
            warn_if_unpicklable(exc, warning_module)  # torch warns as its first worker's start fails
            raise
        self.workers: list[WorkerHandle] = []
        self.backlog: set[WorkerHandle] = set()  # workers whose outbox holds bytes not yet written
        self.generation = 0  # changes whenever ``workers`` does: a poll set over them is rebuilt
        # every worker's nudge (worker.pipes.PipeWatch.nudge) lands here: see ``nudged``. The pool's
        # first descriptors: at a limit they are refused as worker 0's own pipes would have been
        with start_limits.limits_named(num_workers, 0):
            self._nudge_r, self._nudge_w = ctx.Pipe(duplex=False)
        for end in (self._nudge_r, self._nudge_w):
            os.set_blocking(end.fileno(), False)
        self.nudge_fd = self._nudge_r.fileno()

    def nudged(self, ready: list[tuple[int, int]]) -> bool:
        """Whether a poll's ``ready`` holds the nudge pipe: a worker sent a reply that the main
        process must act on at once (a ``TooSmall``), possibly while it slept on another worker's
        pipe. Each nudge waiting is taken, so the pipe wakes no later poll for it."""
        fd = self.nudge_fd
        for polled, _event in ready:
            if polled == fd:
                try:
                    while os.read(fd, 4096):
                        pass
                except OSError:  # BlockingIOError: none left
                    pass
                return True
        return False

    def start_all(self) -> None:
        """Start every worker; each is in ``workers`` as soon as it runs, so ``shutdown`` stops it
        even when a later one fails to start."""
        for worker_id in range(self.num_workers):
            with start_limits.limits_named(self.num_workers, worker_id):
                self._start(worker_id)

    def _start(self, worker_id: int) -> WorkerHandle:
        """Start one worker and put it in ``workers`` at ``worker_id`` (a new place, or its dead
        predecessor's). On any failure nothing of it is left running: no pipe end, and a process
        that exists is reaped (and is in ``workers``, dead, so ``shutdown`` finishes a reap that
        another Ctrl-C cuts short)."""
        task_r, task_w = self.ctx.Pipe(duplex=False)
        try:
            res_r, res_w = self.ctx.Pipe(duplex=False)
        except BaseException:
            close_pipes(task_r, task_w)
            raise
        handle: WorkerHandle | None = None
        try:
            stop = StopFlag(self.ctx)  # its own, clear: a successor is not stopped with its predecessor
            process = self.ctx.Process(  # type: ignore[attr-defined]
                target=worker_main.run,
                args=(self._payload, worker_id, task_r, res_w, os.getpid(), self._death_signal_safe(), stop,
                      self._nudge_w),
                name=f"shmloader-worker-{worker_id}",
                daemon=True,
            )
            handle = WorkerHandle(worker_id, process, task_w, res_r, backlog=self.backlog, task_reader=task_r,
                                  stop=stop)
            live_workers.add(process)
            self._launch(process)
            if not self._forkserver:  # see engine/exits.py
                handle.pidfd = exits.open_pidfd(process)
            else:
                handle.fork_server = exits.fork_server()
            self._place(handle)  # from here shutdown() stops it, whatever is raised next
        except BaseException:
            close_pipes(task_r, res_w)
            if handle is not None and handle.pid is not None:  # it exists (Ctrl-C after the fork)
                self._place(handle)  # first: a reap cut short by another Ctrl-C is shutdown()'s to finish
                reap(handle)
            else:
                close_pipes(task_w, res_r)  # never forked (or too early to know its pid: it reads EOF, exits)
            raise
        close_pipes(res_w)  # the worker's end: it holds its own copy (task_r stays open: ``task_reader``)
        logger.info("worker %d started (pid %s)", worker_id, handle.pid)
        return handle

    def _place(self, handle: WorkerHandle) -> None:
        """Record ``handle`` in ``workers`` at its id (idempotent)."""
        self.generation += 1
        if handle.id < len(self.workers):
            self.workers[handle.id] = handle  # a restart: its predecessor is reaped already
        else:
            self.workers.append(handle)

    def _death_signal_safe(self) -> bool:
        """Whether the worker about to start may die with the thread that forks it (the kernel ties
        ``PR_SET_PDEATHSIG`` to that thread, not to its process): the fork server's main thread, or
        this one when it is the thread-group leader (the main thread, which lasts as long as the
        process: CPython's main thread never ends before its process). Asked in the thread that
        calls ``_start``, so a restart from another thread is judged on its own."""
        return self._forkserver or threading.get_native_id() == os.getpid()

    def _launch(self, process: Any) -> None:
        """``process.start()``; under fork the child freezes what it inherited, at the fork itself.

        ``owner.at_fork_in_child`` runs ``fork_child.freeze_inherited`` in the child inside ``os.fork()``, before
        any of the child's Python code and with the collector held since before the fork (an
        at-fork hook registered before ours may allocate), so no collection can come first. ``gc.freeze()`` splices
        every generation onto the permanent one, which the collector never scans: the child never
        finalizes the parent's cyclic garbage (batches, leases, rings, pin state). It used to be a
        freeze/unfreeze pair around ``start()`` in the parent, skipped where objects were frozen
        already, which on Python 3.12 is always (the interpreter starts with objects of its own
        there): tests/test_fork_gc.py. The mark (``owner.our_fork``) is this thread's, not the
        process's: a worker that another thread starts meanwhile, or a fork of someone else's,
        neither clears nor takes it. The same mark keeps this fork from counting as another's: the
        batches the user holds now need not outlive their slots (docs/design/slot-lifecycle.md).
        Defence in depth: the primary guard is that our finalizers
        check ``ProcessOwner.here`` and do nothing in a forked child.
        """
        if self._forkserver:
            exits.own_fork_server()  # a fork server another process started serves no start of ours
        try:
            if not self._fork:
                process.start()
                return
            with owner.our_fork():
                process.start()
        except Exception as exc:  # a spec of multiprocessing objects is pickled here (payload.py)
            warn_if_unpicklable(exc, self._warning_module)
            raise

    def replace(self, worker_id: int) -> WorkerHandle:
        """Reap the worker at ``worker_id`` (dead, or made to stop: from here it starts no task) and
        start its successor under the same id."""
        old = self.workers[worker_id]
        reap(old)
        with start_limits.limits_named(self.num_workers, worker_id, replacing=old.pid):  # as a start's
            new = self._start(worker_id)  # in workers[worker_id] as soon as it runs
        logger.info("worker %d restarted (pid %s replaces %s)", worker_id, new.pid, old.pid)
        return new

    def retire(self, worker_id: int) -> None:
        """Reap the exited worker at ``worker_id`` and start no successor: its handle stays in its
        place, ``retired``, its pipes closed, until ``shutdown``. Logs nothing: the caller's one
        record names the event (an exit asked for, or a death)."""
        w = self.workers[worker_id]
        reap(w)
        w.retired = True
        self.generation += 1  # a poll set over its closed pipes is rebuilt

    def broadcast(self, msg: Any) -> None:
        for w in self.workers:
            try:
                w.send(msg)
            except (BrokenPipeError, OSError):
                pass  # a dead worker is noticed through its sentinel

    def shutdown(self, grace_s: float = _JOIN_TIMEOUT_S) -> None:
        """Stop every worker: stop flag, polite message (and SIGCONT, for a worker stopped from
        outside, which could not read either), join within ``grace_s``, then terminate and kill.
        From the first step no worker starts a task: each finishes the one it runs and drops its
        queue, so the join waits for one task at most (torch's ``done_event``).

        A broken loader passes a short ``grace_s``: a hung worker would only waste the wait.
        """
        workers, self.workers = self.workers, []
        workers = [w for w in workers if not w.retired]  # reaped already, its exit logged (``retire``)
        self.generation += 1
        try:
            for w in workers:  # every flag first: no worker starts a task while the others are told
                if w.stop is not None:
                    w.stop.set()
            for w in workers:
                try:
                    w.send(None)  # wakes an idle worker; one past its outbox reads its flag instead
                except (BrokenPipeError, OSError):
                    pass
                if exits.stopped(w.process):  # stopped from outside (SIGSTOP): it could not exit within the grace
                    w.signal(signal.SIGCONT)
            deadline = time.monotonic() + grace_s
            for w in workers:
                w.join(max(0.0, deadline - time.monotonic()))
        finally:  # a Ctrl-C during the polite part: off the list already, so stopped here or never
            try:
                reap_all(workers)
            finally:
                close_pipes(self._nudge_r, self._nudge_w)

