"""Deaths of workers: what each becomes, and replacing the dead. Part of step 3 of the
multi-process iterator.

Owns nothing of its own: a mixin of ``MultiProcessIter`` (through ``engine.wait.WaitAndRecover``),
which holds the pool, the ledger, the growing slots and the epoch's record it reads and changes.
Runs in the main process. Promises: a death is turned by ``faults`` into an error (kept in
``_fault``, raised at the next wait, so batches complete before it come first) or into a
successor under the same id that gets, in order, every task of this epoch the dead one held; a
task of an abandoned epoch is let go, never run again. An iterable dataset's worker is replaced
only where it held no position in its stream: its share had ended and it kept no batch for a
growing slot, or the death came before the epoch began for it: before it was sent the epoch's
``Reset`` (``_replace_dead_between_epochs``), before it acknowledged it (``ResetDone``: its
successor is sent the same ``Reset``, then its tasks), or while it was still starting. Without
persistent workers a worker whose share has ended is told to exit as soon as its end is read, as
torch's is (``_release_ended``); its exit, or its death before it, is no fault under any policy,
nor replaced: it is let go (``_let_go``) and reaped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shmloader.engine import exits, faults
from shmloader.engine.growth import Growths
from shmloader.engine.ledger import Key, Ledger, TaskRecord
from shmloader.engine.workers import WorkerHandle
from shmloader.errors import describe_exit
from shmloader.log import logger
from shmloader.state import EpochRecord
from shmloader.transport.messages import Reset


class RecoverDeaths:
    """Deaths seen by ``WaitAndRecover``'s wait, and those seen as a persistent epoch starts."""

    # state and steps of MultiProcessIter that this mixin reads and calls
    _pool: Any
    _ring: Any
    _ledger: Ledger
    _growths: Growths
    _plan: Any
    _policy: faults.FaultPolicy
    _epoch: int
    _record: EpochRecord
    _iterable: bool
    _restarts: int
    _fault: BaseException | None  # a death's error, raised at the next wait (WaitAndRecover._wait)
    _send: Callable[[WorkerHandle, TaskRecord], None]
    _observe: Callable[..., None]  # BaseIter._observe: an observer's error is raised at the next next()
    _drain: Callable[[WorkerHandle], bool]
    _ran_out: Callable[..., None]  # WaitAndRecover._ran_out(task, after_end=True)
    _streak = faults.Streak()  # consecutive deaths of one task (faults.after_death)
    _start_failures: dict[int, int]  # worker id -> deaths in a row before it said Ready
    # ids of the workers sent this epoch's Reset that have not acknowledged it (ResetDone): each has
    # read nothing of the epoch's stream yet (set by MultiProcessIter as it broadcasts the Reset)
    _unbegun: set[int]
    _between_epochs = False  # while a persistent iterator's iter() waits for its workers (MultiProcessIter._catch_up)

    def _tasks_of(self, w: WorkerHandle | None, abandoned: bool = False) -> dict[int, Any]:
        """Task number → sample indices of this epoch's tasks held by ``w`` (None: by every worker);
        ``abandoned``: of earlier epochs' tasks instead, which the workers still run."""
        return {rec.task: rec.indices for rec in self._ledger.records(None if w is None else w.outstanding)
                if (rec.epoch != self._epoch) == abandoned}

    def _replace_dead_between_epochs(self) -> None:
        """Persistent workers that died since the last wait (killed while the trainer validated,
        say), seen as a new epoch starts, before it is sent to any worker: it had not begun for
        them, so the death costs no task an attempt and an iterable worker no position in its
        stream. Replaced, or (policy ``raise``) the error raised at the epoch's first wait."""
        for w in list(self._pool.workers):
            if self._fault is None and not w.running:
                self._drain(w)  # the abandoned epoch's replies: dropped as stale
                self._on_death(w, cause=None, before_epoch=True)

    def _on_death(self, w: WorkerHandle, cause: str | None, before_epoch: bool = False) -> None:
        """A worker died: note the error it becomes (raised at the next wait), or replace it.
        ``before_epoch``: it died before the current epoch began for it (``_replace_dead_between_epochs``).
        A worker that exits (code 0) as it was told once its share ended (``_release_ended``) did
        not die: it is reaped and its exit logged, no observer told of a death."""
        w.join(1.0)
        exitcode = w.process.exitcode
        if w.leaving and exitcode == 0 and cause is None:
            self._let_go(w, exitcode)
            return
        kept = self._kept_by(w)
        tasks = {**self._tasks_of(w), **{rec.task: rec.indices for rec in kept}}
        self._observe(self._plan.events.worker_died, w.id, w.pid, exitcode, tasks)
        if self._ended_for_good(w, kept):
            self._let_go(w, exitcode)
            return
        starting = not w.ready
        head: Key | None = None
        if not starting and w.outstanding and w.outstanding[0][0] == self._epoch:
            head = w.outstanding[0]
        self._streak = faults.after_death(self._streak, head, f"worker {w.id} (pid {w.pid}) "
                                          f"{cause or f'died with {describe_exit(exitcode)}'}")
        self._restarts += 1
        fails = self._start_failures[w.id] = faults.count_start_failure(self._start_failures.get(w.id, 0),
                                                                         starting=starting, exitcode=exitcode)
        lost_position = self._loses_position(w, before_epoch)
        server = w.fork_server if exitcode == faults.FORK_SERVER_LOST_EXIT and exits.fork_server_gone(w.fork_server) else 0
        self._fault = faults.death_error(self._policy, self._streak, restarts=self._restarts, iterable=lost_position,
                                         starting=starting, worker_id=w.id, pid=w.pid, exitcode=exitcode, tasks=tasks,
                                         shm_dir=self._ring.shm_dir, start_failures=fails,
                                         start_method=self._plan.context.get_start_method(), cause=cause,
                                         fork_server=server)
        if self._fault is None:
            self._restart(w)

    def _loses_position(self, w: WorkerHandle, before_epoch: bool = False) -> bool:
        """Whether ending ``w`` now (a death, or a kill for a hang) loses samples of an iterable
        dataset's stream, so that no successor can take its place. An iterable worker whose share
        had ended holds no position: replaceable, unless it kept a batch for a slot still growing
        (its successor's stream starts afresh); nor does one that had read nothing of this epoch
        (still starting, or not past the epoch's ``Reset``): its successor reads its share from the
        start. ``before_epoch``: as ``_on_death``'s; so is every death while ``iter()`` waits for the
        workers, before the epoch's ``Reset`` is sent (``_between_epochs``)."""
        if not self._iterable:
            return False
        unbegun = before_epoch or self._between_epochs or not w.ready or w.id in self._unbegun
        return not unbegun and (not w.exhausted or bool(self._kept_by(w)))

    def _ended_for_good(self, w: WorkerHandle, kept: list[TaskRecord]) -> bool:
        """Whether ``w``, dead, is owed nothing and owes nothing: an iterable worker whose share of
        this epoch had ended (the main process read its end, and it kept no batch for a growing
        slot: ``kept``, ``_kept_by(w)``), without persistent workers, so that no later epoch asks it
        for anything. torch's
        such worker is told to exit as soon as its end is read; a kill from outside finds it gone
        and the epoch ends whole (tests/test_ended_worker_death.py)."""
        return self._iterable and not self._plan.persistent and w.exhausted and not kept

    def _release_ended(self, w: WorkerHandle) -> None:
        """``w``'s end was read: without persistent workers, tell it to exit now, as torch tells its
        worker (``_mark_worker_as_unavailable``): its stop flag, then ``None``, so that it drops
        the tasks dealt to it after its end, which are passed over here as their ``Exhausted``
        would have been. Not while it keeps a batch for a growing slot (``_kept_by``): asked again
        when that task is answered. Its exit is seen by the wait, and reaped (``_let_go``)."""
        if w.leaving or not self._iterable or self._plan.persistent or self._kept_by(w):
            return
        w.leaving = True
        if w.stop is not None:
            w.stop.set()
        try:
            w.send(None)
        except OSError:
            pass  # gone already: its sentinel tells
        self._pass_over(w)

    def _pass_over(self, w: WorkerHandle) -> None:
        """Each task held by ``w`` (dealt after its end, so never answered now) leaves the ledger,
        this epoch's passed over as its ``Exhausted`` would have been."""
        for rec in list(self._ledger.records(w.outstanding)):
            w.pop(rec.key)
            self._ledger.release(rec)
            if rec.epoch == self._epoch:
                self._ran_out(rec.task)

    def _let_go(self, w: WorkerHandle, exitcode: int | None) -> None:
        """The exit of an ended worker: the one it was told to make (``_release_ended``), or a death
        (``_ended_for_good``): not an error, and no successor, under either policy. Its tasks are
        passed over; the worker is reaped and never polled again. One record: an info for the exit
        asked for, a warning for a death."""
        if w.leaving and exitcode == 0:
            logger.info("worker %d (pid %s) exited: its share of the epoch had ended", w.id, w.pid)
        else:
            logger.warning("worker %d (pid %s) died with %s after its share of the epoch had ended: nothing "
                           "was lost, and it is not replaced", w.id, w.pid, describe_exit(exitcode))
        self._pass_over(w)
        self._pool.retire(w.id)

    def _kept_by(self, w: WorkerHandle) -> list[TaskRecord]:
        """This epoch's tasks whose batch ``w`` keeps for the retry in a grown slot (worker.main
        ``_remember``), so that its death loses those samples of a stream: those waiting for their
        slot to grow, and those sent back to it in the grown slot and not answered yet (an ended
        worker's successor used to pass such a task over as ``Exhausted``, the batch lost
        silently: tests/test_adv_fault_growth_retry.py)."""
        pid = w.pid or -1  # a record no worker keeps has kept_by 0
        return [rec for rec in (*self._growths.waiting, *self._ledger.records(w.outstanding))
                if rec.kept_by == pid and rec.epoch == self._epoch]

    def _restart(self, w: WorkerHandle) -> None:
        """Start a successor under the same id and re-send, in order, every task the dead one held
        (first this epoch's ``Reset``, where the dead one had not acknowledged it)."""
        keys = list(w.outstanding)
        new = self._pool.replace(w.id)
        new.exhausted = w.exhausted  # an iterable worker's ended share stays ended until the next epoch
        if w.id in self._unbegun:  # the successor begins the epoch as the others did: same reseed, then its tasks
            try:
                new.send(Reset(self._epoch, self._plan.reset_seed))
            except OSError:
                pass  # dead already: its sentinel reports it
        for rec in self._ledger.records(keys):
            if rec.epoch != self._epoch:
                self._ledger.release(rec)  # an abandoned epoch's task: not worth running again
            elif new.exhausted:  # what its reply would have been: Exhausted (worker.fetch)
                self._ledger.release(rec)
                self._ran_out(rec.task)
            else:
                self._send(new, rec)
        self._observe(self._plan.events.worker_restarted, new.id, new.pid, w.pid)  # its tasks are sent first
