"""Waiting on workers and recovering from their faults: step 3 of the multi-process iterator.

Owns nothing of its own: a mixin of ``MultiProcessIter`` (``mp_iterator.py``), which holds the
pool, the ledger, the reorder buffer and the dispatcher this step reads and changes. Runs in the
main process. Promises: ONE blocking wait (a ``select.poll`` kept across calls, which is what
``multiprocessing.connection.wait`` does inside) over every worker's process sentinel and every
reply pipe whose reply could be used now (where only the due batch's could, its worker's:
``_head_poller``), bounded only by ``timeout=`` and the per-task hang deadline, so a death is seen at once;
each reply is processed exactly once, and its slot moves only through the ledger; a death is
turned by ``faults`` into an error or into a replacement worker that gets the dead one's tasks
again, each task delivered once.

The named steps: ``wait`` → ``process`` (one reply) → ``on_death`` (decide: ``engine.deaths``) →
``restart`` or the fault raised at the next wait; ``on_quiet`` when the wait times out (``kill_hung`` or torch's
timeout error); ``regrow`` (a ``TooSmall`` reply: the slot starts growing, ``engine.growth``) and
``grow`` (run instead of blocking while slots grow: their bytes reserved a part at a time, each
task sent again once its slot is whole, stopping as soon as a reply waits); a growth refused for
lack of room is its task's outcome (``refused``), raised when the task is due.
"""

from __future__ import annotations

import dataclasses
import math
import select
import signal
import time
from collections.abc import Callable
from typing import Any

from shmloader.engine import exits, faults
from shmloader.engine.caller import Caller
from shmloader.engine.deaths import RecoverDeaths
from shmloader.engine.growth import Growths, Refused
from shmloader.engine.ledger import Ledger, TaskRecord
from shmloader.engine.reaping import join_killed
from shmloader.engine.slot_size import SlotSize
from shmloader.engine.workers import WorkerHandle
from shmloader.kept import keep
from shmloader.log import logger
from shmloader.state import EpochRecord
from shmloader.transport.messages import Exhausted, Failed, Filled, Ready, ResetDone, TooSmall
from shmloader.transport.preflight import CONSUMER_SLOTS

# poll() takes at most 2**31 - 1 ms (24.8 days); a longer timeout= waits again when this one ends
_MAX_POLL_MS = 2**31 - 1


class WaitAndRecover(RecoverDeaths):
    """Step 3 of ``MultiProcessIter``: wait, process replies, handle deaths and hangs."""

    # state and steps of MultiProcessIter that this mixin reads and calls
    _pool: Any
    _guard: Any  # engine.stepguard.StepGuard: its wake-up pipe is polled with the workers'
    _ring: Any
    _ledger: Ledger
    _growths: Growths
    _reorder: Any
    _plan: Any
    caller: Caller  # BaseIter.caller: who drives this epoch, as the advice of its errors names the calls
    _policy: faults.FaultPolicy
    _epoch: int
    _record: EpochRecord  # the epoch's record (BaseIter): which tasks are done
    _iterable: bool
    _slot_size: SlotSize
    _sampler_done: bool
    _fail: Callable[[BaseException], BaseException]
    _send: Callable[[WorkerHandle, TaskRecord], None]
    _flush_detach: Callable[[], None]
    _capacity: Callable[[], int]
    _dispatcher: Any  # engine.dispatch.Dispatcher: counts the tasks passed over after a share's end
    _worker_exception: Callable[[Failed, int, TaskRecord | None], BaseException]

    # -- 3. wait and process -------------------------------------------------------------------
    # A death the policy turns into an error is raised at the next wait, so batches that were
    # complete before it (drained in the same wait) are handed out first, as torch hands them out.
    _fault: BaseException | None = None

    def _wait(self, started: float) -> None:
        if self._fault is not None:
            fault, self._fault = self._fault, None
            try:
                raise self._fail(fault)
            finally:
                del fault  # else its traceback holds this frame, which holds it: a cycle only the collector frees
        poller, by_fd = self._poller()
        if self._pool.backlog or self._room_polled:
            self._flush_backlog(poller, by_fd)
        if self._deadlined:
            timeout_s = self._wait_timeout(started)
            ms = None if timeout_s is None else min(math.ceil(timeout_s * 1000), _MAX_POLL_MS)
        else:
            ms = None
        if self._head_only:  # what is there now, from any worker; asleep, woken by the due batch only
            ready = poller.poll(0)
            if not ready and ms != 0:
                ready = self._head_poller(poller).poll(ms)
                if ready and self._pool.nudged(ready):  # or by a reply to act on at once: read them all
                    ready = poller.poll(0)
        else:
            ready = poller.poll(ms)
        if not ready:
            self._on_quiet(started)
            return
        dead: list[WorkerHandle] = []
        for fd, _event in ready:  # every whole reply waiting on a ready pipe, one read each
            if fd not in by_fd:
                continue  # the step guard's wake-up: the step loop sees the stop request next
            w, is_sentinel = by_fd[fd]
            if is_sentinel:
                dead.append(w)
                continue
            if is_sentinel is None:  # a task pipe with room again: written at the next wait
                continue
            try:
                replies = w.read_replies()
            except (EOFError, OSError):
                dead.append(w)
                continue
            for msg in replies:
                self._process(w, msg)
        for w in dict.fromkeys(dead) if dead else ():
            if self._fault is None and self._pool.workers[w.id] is w:
                self._drain(w)
                self._on_death(w, cause=None)

    _poll_set: tuple[int, Any, dict[int, tuple[WorkerHandle, bool | None]]] | None = None  # (pool generation, ...)
    _deadlined = True  # set by MultiProcessIter: False when neither timeout= nor a task deadline applies
    _room_polled: set[int]  # task pipes polled for room (POLLOUT), set anew with the poll set
    _head_only = False  # set by MultiProcessIter: asleep, the wait is woken by the due batch's worker only
    _head_pollers: dict[int, Any]  # worker id -> its poll set for sleeping (_head_poller), set anew with the poll set

    def _poller(self) -> tuple[Any, dict[int, tuple[WorkerHandle, bool | None]]]:
        """One ``select.poll`` over every worker's reply pipe and process sentinel — what
        ``multiprocessing.connection.wait`` does, without building a selector per call (issue 16).
        Rebuilt when the set of workers changes (a restart). ``by_fd`` maps a polled fd to its
        worker and what it is: True its sentinel, False its reply pipe, None its task pipe, polled
        for room while its outbox is not empty (``_flush_backlog``)."""
        generation = self._pool.generation
        if self._poll_set is None or self._poll_set[0] != generation:
            by_fd: dict[int, tuple[WorkerHandle, bool | None]] = {}
            for w in self._pool.workers:
                if w.retired:
                    continue  # dead, its pipes closed, nothing more to say (deaths.py)
                by_fd[w.results.fileno()] = (w, False)
                by_fd[w.exit_fd] = (w, True)  # its pidfd where there is one: engine/exits.py
            self._poll_set = (generation, self._new_poll(by_fd), by_fd)
            self._room_polled = set()
            self._head_pollers = {}
        return self._poll_set[1], self._poll_set[2]

    def _drop_poll_set(self) -> None:
        """Forget the poll sets (the iterator is shut): their reaped workers' process objects keep two
        pipe descriptors each open for as long as the caller keeps the shut iterator."""
        self._poll_set = None
        self._head_pollers = {}

    def _head_poller(self, poller: Any) -> Any:
        """The poll set to sleep on: every sentinel, the step guard's pipe and the reply pipe of the
        worker that holds the batch due next, and no other reply pipe.

        With in-order delivery another worker's reply cannot be handed out yet, and under
        round-robin dispatch (in order, map-style, no task deadline) it frees no room for a task
        either: waking for it cost the main process a sleep and a wake-up for nothing (issue 16:
        on 2 cores, a fifth of the wake-ups for ``tiny`` and almost half for ``image``; two thirds
        with 8 workers). It waits in its pipe and is read in the wait that finds it there. Deaths
        are seen at once as before (the sentinels). A reply the main process must act on at once
        (another worker's ``TooSmall``: its slot grows while the due batch is awaited) comes with a
        byte on the pool's nudge pipe, also polled here, after which every reply waiting is read
        (tests/test_wait_nudge.py). While slots grow, while a task pipe is polled
        for room, or when the due task is at no worker, the full set (``poller``) is used.
        """
        if self._growths.waiting or self._room_polled:
            return poller
        rec = self._ledger.get((self._epoch, self._reorder.next_due))
        if rec is None:
            return poller
        head = self._head_pollers.get(rec.worker_id)
        if head is None:
            by_fd = self._poller()[1]
            reply = self._pool.workers[rec.worker_id].results.fileno()
            head = self._head_pollers[rec.worker_id] = self._new_poll(
                [fd for fd, (_w, is_sentinel) in by_fd.items() if is_sentinel or fd == reply] + [self._pool.nudge_fd])
        return head

    def _new_poll(self, fds: Any) -> Any:
        """A ``select.poll`` for input on ``fds`` and on the step guard's pipe (``close()`` from
        another thread)."""
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        if self._guard.wake_fd >= 0:
            poller.register(self._guard.wake_fd, select.POLLIN)
        return poller

    def _flush_backlog(self, poller: Any, by_fd: dict[int, tuple[WorkerHandle, bool | None]]) -> None:
        """Write what each task pipe takes now of its worker's outbox, and poll a pipe that is still
        full for room (``POLLOUT``) until it is empty; the wait never blocks on a write. A worker
        gone meanwhile drops its outbox: its sentinel reports the death."""
        for w in list(self._pool.backlog):
            try:
                w.flush()
            except OSError:
                continue
        room = self._room_polled
        for fd in [fd for fd in room if by_fd[fd][0] not in self._pool.backlog]:  # emptied: stop polling
            poller.unregister(fd)
            del by_fd[fd]
            room.discard(fd)
        for w in self._pool.backlog:
            fd = w.tasks.fileno()
            if fd not in room:
                poller.register(fd, select.POLLOUT)
                by_fd[fd] = (w, None)
                room.add(fd)

    def _wait_timeout(self, started: float) -> float | None:
        deadlines = []
        timeout_s = self._plan.timeout_s
        if timeout_s > 0:
            deadlines.append(started + timeout_s)
        if self._policy.task_timeout_s > 0:
            deadlines += [w.head_since + self._policy.deadline_s(w.ready) for w in self._pool.workers
                          if w.outstanding]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _drain(self, w: WorkerHandle) -> bool:
        """Process every reply waiting on ``w``'s pipe; False when the pipe is closed (worker gone)."""
        try:
            while w.results.poll():  # readable: a reply (or the part of one the reader waits for), or EOF
                for msg in w.read_replies():
                    self._process(w, msg)
        except (EOFError, OSError):
            return False
        return True

    def _process(self, w: WorkerHandle, msg: Any) -> None:
        if isinstance(msg, Ready):
            w.ready = True
            w.head_since = time.monotonic()  # the first task's deadline starts now, not at dispatch
            return
        if isinstance(msg, ResetDone):
            if msg.epoch == self._epoch:
                self._unbegun.discard(w.id)  # it reads the epoch's stream from now on (deaths.py)
            return
        if isinstance(msg, Failed) and msg.task is None:
            # the next task could not be unpickled, and replies come in task order, so that task is
            # the oldest one the worker holds
            if msg.starting and w.outstanding:  # a worker that could not start: its answer to that task
                msg = dataclasses.replace(msg, epoch=w.outstanding[0][0], task=w.outstanding[0][1])
            else:
                head = self._ledger.get(w.outstanding[0]) if w.outstanding else None
                if self._fault is None:  # raised at the next wait: the batches finished before it come first
                    self._fault = keep(self._worker_exception(msg, w.id, head))
                return
        rec = self._ledger.get((msg.epoch, msg.task))
        if rec is None:
            return
        stale = msg.epoch != self._epoch
        if isinstance(msg, TooSmall) and not stale:
            self._regrow(w, rec, msg.needed_bytes)
            return
        w.pop(rec.key)
        if isinstance(msg, Filled) and not stale:
            self._slot_size.observe(self._ledger.fill(rec, msg.slot_id, msg.used_bytes))
            self._reorder.put(rec.task, (rec, msg))
            if w.exhausted:  # the retry of a batch it kept past its end: it may leave now
                self._release_ended(w)
            return
        self._ledger.release(rec)  # failed, exhausted, or a reply of an abandoned epoch: no view is made
        if stale:
            return
        if isinstance(msg, Failed):  # a start-up failure too: the worker's first task is where torch raises it
            self._reorder.put(rec.task, (rec, msg))  # raised when it is due, as torch raises it
        elif isinstance(msg, Exhausted):
            self._ran_out(rec.task, after_end=w.exhausted)  # the first is its end; a later one, dealt after it
            w.exhausted = True
            if all(h.exhausted for h in self._pool.workers):
                self._sampler_done = True
            self._release_ended(w)  # told to exit at once, as torch's (deaths.py)

    def _ran_out(self, task: int, after_end: bool = True) -> None:
        """Task ``task`` found its worker's share of an iterable dataset ended: it has no batch. It is
        passed over when due, and the epoch's record counts it done, as a delivered one: else the
        record's ``[0, low)`` stopped below it and every later task of the (possibly endless) epoch
        was kept one by one above it (tests/test_leak_uneven_shards.py). ``after_end``: it was dealt
        after the task that found the end, so it keeps its place in the pipeline, as torch's count
        keeps it (``Dispatcher.passed_over``); the task that found the end is replaced."""
        self._reorder.skip(task)
        self._record.delivered.add(task)
        if after_end:
            self._dispatcher.passed_over()

    def _regrow(self, w: WorkerHandle, rec: TaskRecord, needed: int) -> None:
        """The batch did not fit: a larger slot for this task (and every later one), same worker.

        The slot starts growing here; ``_grow`` reserves its bytes and sends the task again. The
        task leaves its worker meanwhile, its slot unchanged. When there is no room, ``_refused``.
        """
        slot_bytes = self._slot_size.grown(needed)
        w.pop(rec.key)
        rec.kept_by = w.pid or 0  # until its retry is answered, that worker keeps the batch (deaths.py)
        try:
            self._plan.preflight(self._ring, slot_bytes, self._capacity() + CONSUMER_SLOTS)
            self._growths.start(rec, slot_bytes)
        except Exception as exc:  # no room
            self._refused(rec, exc)
            return
        self._slot_size.grew_to(slot_bytes, needed)

    def _refused(self, rec: TaskRecord, exc: BaseException) -> None:
        """The task's slot cannot grow: the loader is broken, but the error is the task's outcome,
        raised when the task is due (``Refused``), so every batch due before it is handed out
        first, those still in flight too (tests/test_growth_refused_due.py, test_growth_deep.py).
        Its slot goes back to the ring now."""
        self._ledger.release(rec)
        self._reorder.put(rec.task, (rec, Refused(keep(exc))))

    def _grow(self) -> None:
        """Reserve growing slots a part at a time, the earliest task first, and send each task
        again once its slot has grown; return as soon as a reply or a death waits, so that a batch
        that became due meanwhile is delivered first (issue 16). Called instead of blocking: when
        it returns, either nothing grows any more or ``_wait`` has something to read at once; a
        growth refused here is its task's outcome (``_refused``), which the step loop hands out
        when due rather than waiting (tests/test_growth_refused_due.py)."""
        poller, _by_fd = self._poller()
        while self._growths.waiting:
            try:
                rec = self._growths.step()
            except Exception as exc:  # no room after all
                self._refused(self._growths.refuse(), exc)
                continue
            if rec is not None:
                self._flush_detach()
                self._send(self._pool.workers[rec.worker_id], rec)
            if poller.poll(0):
                return

    def _on_quiet(self, started: float) -> None:
        """The wait timed out: a hung worker (task deadline) or the loader's ``timeout=``, which kills
        no worker: the iterator is shut down, or with persistent workers (the loader's) runs on:
        ``next()`` waits again, ``iter(loader)`` abandons the epoch (docs/reliability.md, "Hangs")."""
        now = time.monotonic()
        for w in list(self._pool.workers):
            limit = self._policy.deadline_s(w.ready)
            if limit > 0 and w.outstanding and now >= w.head_since + limit:
                self._kill_hung(w, limit)
                return
        timeout_s = self._plan.timeout_s
        if timeout_s > 0 and now >= started + timeout_s:
            for w in list(self._pool.workers):  # the sleeping wait left other workers' replies unread:
                self._drain(w)  # what they finished is not outstanding, and must not be named so
            if self._reorder.has_due() or self._fault is not None:
                return  # the due batch (or a failure) came as time ran out: the step loop takes it
            held = {w.id: w.pid for w in self._pool.workers if w.outstanding}
            stopped = [w.id for w in self._pool.workers if w.outstanding and exits.stopped(w.process)]
            kept = self._plan.persistent  # the loader's workers: a slow one is not killed for it (torch's)
            if not kept:
                raise self._fail(faults.timed_out(timeout_s, self._tasks_of(None), held, stopped=stopped))
            # the step loop lets a kept timeout through (_plan.persistent), the iterator still running
            raise faults.timed_out(timeout_s, self._tasks_of(None), held, kept=True, caller=self.caller,
                                   abandoned=self._tasks_of(None, abandoned=True), stopped=stopped)

    def _kill_hung(self, w: WorkerHandle, limit_s: float) -> None:
        """Kill ``w``, which held a task past its deadline when the wait timed out, unless the
        replies now waiting on its pipe say otherwise: read first, a batch that came as the wait
        ended is used, never thrown away with its worker and its task re-run as an attempt."""
        self._drain(w)  # a closed pipe (a death) is left to the kill and join below
        if self._fault is not None:
            return  # raised at the next wait, which shuts every worker down
        limit_s = self._policy.deadline_s(w.ready)  # a Ready just read ends the start-up deadline
        if not w.outstanding or time.monotonic() < w.head_since + limit_s:
            return  # it answered: the task it works on now has its own deadline
        key = w.outstanding[0]
        rec = self._ledger.get(key)
        logger.warning("worker %d (pid %s) spent more than %s s on %s; killing it", w.id, w.pid, limit_s,
                       f"task {key[1]}" if w.ready else "start-up")
        # an iterable worker that read nothing of its stream yet (starting, or hung in __iter__ at
        # the epoch's Reset) loses no position: replaced under the restart policy, as its death is
        lost_position = self._loses_position(w)
        stopped = exits.stopped(w.process)  # by a signal from outside, not slow: the error says so
        w.signal(signal.SIGKILL)
        join_killed(w)  # bounded: a worker in uninterruptible sleep may outlive SIGKILL a while
        if not self._policy.restart or lost_position:
            raise self._fail(faults.hung(w.id, w.pid, key[1], rec.indices if rec else None, limit_s,
                                         starting=not w.ready, iterable=lost_position,
                                         abandoned=key[0] != self._epoch, stopped=stopped))
        self._on_death(w, cause=faults.hang_cause(limit_s, starting=not w.ready, stopped=stopped))
