"""The fault policy: what a worker death, a hang or a timeout becomes.

Owns the decision (raise, or restart the worker and re-dispatch its tasks; when a task is poison;
when the restart budget is spent: :func:`after_death` and :func:`death_error`) and the wording of
every such error. Pure apart from reading measurements for hints (free bytes of the shm directory,
the cgroup's OOM-kill count). Runs in the main process.

The poison rule (docs/reliability.md): a task is poison when the workers running it died
``max_task_attempts`` times *in a row* — no other task's worker died in between. A death while a
worker runs some other task breaks the streak: deaths spread over tasks come from outside the
task (a stress script or an OOM killer picking workers, a preempting scheduler) and are bounded by
``max_restarts`` instead, never blamed on whichever task happened to be running. Deaths while a
worker starts, or while it is idle, neither count nor break a streak. Messages keep torch's words where users grep for them ("DataLoader worker ...
exited unexpectedly", "DataLoader timed out after N seconds") and add the facts torch leaves out.
"""

from __future__ import annotations

import signal
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from shmloader.engine.caller import LOADER, Caller
from shmloader.errors import (
    LoaderError,
    PoisonTask,
    RestartBudgetExceeded,
    WorkerDied,
    WorkerHung,
    WorkerTimeout,
    describe_exit,
    format_indices,
    format_tasks,
    plain_indices,
    rebuild_worker_exception,
    signal_name,
)
from shmloader.transport import exc_types, shm_space
from shmloader.worker.pipes import LOST_PIPE_EXIT

Tasks = Mapping[int, Any]  # task -> its indices as the sampler made them (None: iterable dataset)
Key = tuple[int, int]  # (epoch, task)

# A worker's start-up (unpickling the dataset, importing, worker_init_fn) may legitimately take far
# longer than one task, above all under spawn; with task_timeout_s set, it gets at least this long.
START_TIMEOUT_FLOOR_S = 30.0
START_ATTEMPTS = 2  # a worker that failed to start this many times in a row is not restarted again
MAIN_GUARD_DOCS = "https://docs.python.org/3/library/multiprocessing.html#the-spawn-and-forkserver-start-methods"


@dataclass(frozen=True)
class FaultPolicy:
    on_worker_death: str = "raise"  # "raise" | "restart"
    max_restarts: int = 16
    max_task_attempts: int = 3
    task_timeout_s: float = 0.0

    @property
    def restart(self) -> bool:
        return self.on_worker_death == "restart"

    def deadline_s(self, ready: bool) -> float:
        """How long a worker may hold its oldest task without a reply; 0 is no deadline.

        A worker still starting gets ``max(task_timeout_s, START_TIMEOUT_FLOOR_S)``.
        """
        if self.task_timeout_s <= 0 or ready:
            return self.task_timeout_s
        return max(self.task_timeout_s, START_TIMEOUT_FLOOR_S)


@dataclass(frozen=True)
class Streak:
    """Consecutive worker deaths, each while the same task was the one its worker ran."""

    key: Key | None = None
    deaths: tuple[str, ...] = ()


def after_death(streak: Streak, head: Key | None, death: str) -> Streak:
    """The streak after a death; ``head`` is the task the worker was running (None: starting or idle)."""
    if head is None:
        return streak
    if head == streak.key:
        return Streak(head, (*streak.deaths, death))
    return Streak(head, (death,))


def count_start_failure(previous: int, *, starting: bool, exitcode: int | None) -> int:
    """A worker id's deaths in a row while starting that it caused itself (an exit code: a failed
    import, a missing main-module guard, ``os._exit`` in ``worker_init_fn``). A signal while
    starting (an outside kill, an OOM kill) neither counts nor clears the count; a death after
    the worker said Ready clears it."""
    if not starting:
        return 0
    return previous + 1 if exitcode is not None and exitcode > 0 else previous


def death_error(policy: FaultPolicy, streak: Streak, *, restarts: int, iterable: bool, starting: bool,
                worker_id: int, pid: int | None, exitcode: int | None, tasks: Tasks, shm_dir: str,
                start_failures: int = 0, start_method: str = "fork", cause: str | None = None,
                fork_server: int = 0) -> BaseException | None:
    """The error a death becomes, or None when the worker is to be replaced and its tasks re-sent.

    ``restarts`` counts this epoch's deaths, this one included; ``streak`` is :func:`after_death`'s
    result for this death; ``tasks`` maps the dead worker's tasks (oldest first) to their indices;
    ``start_failures`` is :func:`count_start_failure`'s count for this worker id. A worker that
    exited by itself while starting on two attempts in a row will not start on a third (a missing
    main guard under spawn, an import error, a dataset that cannot be unpickled): it is reported
    at once, without suggesting a restart. ``cause``: the loader's own words for a worker it killed
    (:func:`hang_cause`), None for a death it did not cause. ``fork_server``: the pid of the fork
    server that started the worker when it died and took the worker's exit status with it, else 0.
    """
    if start_failures >= START_ATTEMPTS:
        return died(worker_id, pid, exitcode, tasks, shm_dir, iterable=iterable, starting=True,
                    start_method=start_method, attempts=start_failures)
    if not policy.restart or iterable:
        return died(worker_id, pid, exitcode, tasks, shm_dir, iterable=iterable, starting=starting,
                    start_method=start_method, fork_server=fork_server)
    if restarts > policy.max_restarts:
        return budget_spent(worker_id, pid, exitcode, tasks, policy.max_restarts, starting=starting, cause=cause)
    if starting or streak.key is None or len(streak.deaths) < policy.max_task_attempts:
        return None
    task = streak.key[1]
    return poison(task, tasks.get(task), len(streak.deaths), streak.deaths)


def hints(shm_dir: str, exitcode: int | None) -> list[str]:
    """Guesses about a death, each backed by a measurement; empty when nothing points anywhere."""
    found: list[str] = []
    if exitcode == -signal.SIGKILL:
        now = _cgroup_oom_kills()
        if now > _OOM_KILLS_AT_START:
            found.append(f"hint: the cgroup's oom_kill count rose from {_OOM_KILLS_AT_START} to {now} while "
                         "this process ran; the kernel's OOM killer may have killed the worker")
    if exitcode == 0:
        found.append("hint: exit code 0 means the worker ended by itself without being asked to: sys.exit(), a "
                     "SystemExit or os._exit(0) in the dataset, collate_fn or worker_init_fn?")
    if exitcode == LOST_PIPE_EXIT:
        found.append(f"hint: exit code {LOST_PIPE_EXIT} is the worker's own when a pipe to the main process was "
                     "closed or replaced by the dataset, collate_fn or worker_init_fn (a descriptor they did not "
                     "open); the worker's stderr names the descriptor")
    if exitcode == -signal.SIGBUS:
        free = shm_space.shm_free_bytes(shm_dir)
        if free is not None:
            found.append(f"hint: SIGBUS often means {shm_dir} ran out of space; it has {free} bytes free now")
    return found


def _cgroup_oom_kills() -> int:
    """The cgroup's count of OOM kills (v2 ``memory.events`` or v1 ``memory.oom_control``); 0 if unreadable."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return 0


def _attr(tasks: Tasks) -> Mapping[int, Sequence[int]]:
    """The ``tasks`` attribute of an error (an iterable dataset's tasks have None for indices)."""
    return cast("Mapping[int, Sequence[int]]", tasks)


def _held(tasks: Tasks, starting: bool) -> str:
    """Where the worker was: starting, idle, or running its oldest task (and what else it held)."""
    items = list(tasks.items())
    rest = "; ".join(f"task {t} (sample indices {format_indices(i)})" for t, i in items[1:])
    if starting:
        waiting = f"; tasks waiting for it: {format_tasks(tasks)}" if tasks else ""
        return ("while starting (loading the dataset, seeding, running worker_init_fn), before it took a "
                f"task{waiting}")
    if not items:
        return "while idle (it held no task)"
    task, indices = items[0]
    return (f"while running task {task} (sample indices {format_indices(indices)})"
            + (f"; it also held {rest}" if rest else ""))


def torch_words(pid: int | None, exitcode: int | None) -> str:
    """torch's own words for a dead worker, which logs and retry wrappers search for: "DataLoader
    worker (pid N) is killed by signal: Killed" (the signal's description), or "... exited
    unexpectedly with exit code 3"; ours add the signal's name and number."""
    if exitcode is not None and exitcode < 0:
        name = signal_name(-exitcode)
        text = signal.strsignal(-exitcode) or name
        return f"DataLoader worker (pid {pid}) is killed by signal: {text} ({name}, {-exitcode})"
    return f"DataLoader worker (pid {pid}) exited unexpectedly with {describe_exit(exitcode)}"


def died(worker_id: int, pid: int | None, exitcode: int | None, tasks: Tasks, shm_dir: str,
         *, iterable: bool = False, starting: bool = False, start_method: str = "fork",
         attempts: int = 1, fork_server: int = 0) -> WorkerDied:
    """torch's "DataLoader worker ... exited unexpectedly", with worker, pid, cause and tasks.

    ``tasks`` is in the worker's order: the first is the one it was running. A worker that died
    while starting is never advised to be restarted: a restart starts it the same way again.
    ``fork_server``: as :func:`death_error`'s; the exit code is then multiprocessing's stand-in.
    """
    head = torch_words(pid, exitcode) if not fork_server else _lost_with_fork_server(pid, fork_server)
    lines = [
        f"{head}. Worker {worker_id} died {_held(tasks, starting)}"
        + (f", on each of {attempts} attempts in a row." if attempts > 1 else "."),
        *hints(shm_dir, exitcode if not fork_server else None),
    ]
    if starting:
        lines += _start_advice(start_method, exitcode)
    elif iterable:
        lines.append("A worker of an IterableDataset cannot be restarted, even with "
                     "on_worker_death='restart': its position in the stream died with it.")
    else:
        lines.append("To replace dead workers and re-run their tasks, pass on_worker_death='restart' "
                     "(or set SHMLOADER_ON_WORKER_DEATH=restart).")
    return WorkerDied("\n".join(lines), worker_id=worker_id, pid=pid, exitcode=exitcode, tasks=_attr(tasks))


FORK_SERVER_LOST_EXIT = 255  # multiprocessing's exit code for a forkserver worker whose fork server is gone


def _lost_with_fork_server(pid: int | None, server: int) -> str:
    """torch's first words for a death whose exit status died with the fork server that started it."""
    return (f"DataLoader worker (pid {pid}) exited unexpectedly; its exit status is unknown: the fork server "
            f"(pid {server}) that started it is gone (killed from outside?), and its workers die with it "
            f"(under the 'forkserver' start method a worker's exit status comes from its fork server: "
            f"multiprocessing reports exit code {FORK_SERVER_LOST_EXIT})")


def _start_advice(start_method: str, exitcode: int | None) -> list[str]:
    """What to check when a worker cannot start: its own traceback, and the main-module guard."""
    advice = ["The worker's own traceback, if it printed one, is on this process's stderr above."]
    if start_method in ("spawn", "forkserver") and exitcode == 1:
        advice.append(
            f"hint: under the {start_method!r} start method each worker imports your main module again; a "
            "script that creates and iterates the DataLoader at module level, without "
            "`if __name__ == \"__main__\":`, fails there while bootstrapping (Python's multiprocessing raises "
            f"'An attempt has been made to start a new process ...'). Put the loop under that guard: {MAIN_GUARD_DOCS}")
    return advice


STOPPED_WORDS = "stopped by a signal (SIGSTOP or SIGTSTP: state T in /proc/<pid>/stat)"


def hang_cause(limit_s: float, starting: bool, stopped: bool = False) -> str:
    """How a worker the loader killed for passing its deadline ended, naming that deadline;
    ``stopped``: it was stopped by a signal then (``exits.stopped``), not slow."""
    deadline = (f"the start-up deadline, max(task_timeout_s, {START_TIMEOUT_FLOOR_S})" if starting
                else "task_timeout_s")
    return f"hung for more than {limit_s} s ({deadline}){f', {STOPPED_WORDS},' if stopped else ''} and was killed"


def budget_spent(worker_id: int, pid: int | None, exitcode: int | None, tasks: Tasks,
                 max_restarts: int, *, starting: bool = False, cause: str | None = None) -> RestartBudgetExceeded:
    """The restart budget spent by this death; ``cause``: the loader's kill for a hang (``hang_cause``),
    which the message names instead of the signal, with the deadline to raise."""
    how = (f"DataLoader worker {worker_id} (pid {pid}) {cause}" if cause
           else f"{torch_words(pid, exitcode)}: worker {worker_id}, which died")
    advice = ("or task_timeout_s (SHMLOADER_TASK_TIMEOUT_S), or find why it hangs" if cause
              else "or find what kills workers")
    msg = (f"{how} {_held(tasks, starting)}, and the restart budget "
           f"of max_restarts={max_restarts} restarts this epoch is spent. Raise max_restarts "
           f"(SHMLOADER_MAX_RESTARTS) {advice}.")
    return RestartBudgetExceeded(msg, worker_id=worker_id, pid=pid, exitcode=exitcode, tasks=_attr(tasks))


def poison(task: int, indices: Any, attempts: int, deaths: Sequence[str]) -> PoisonTask:
    msg = (f"task {task} (sample indices {format_indices(indices)}) killed its worker on each of "
           f"{attempts} attempts and is not retried again: " + _some(deaths) +
           ". Check those samples; max_task_attempts (SHMLOADER_MAX_TASK_ATTEMPTS) sets the bound.")
    exc = PoisonTask(msg, task=task, indices=indices, attempts=attempts, deaths=deaths)
    exc.tasks = {task: exc.indices}  # as the other errors carry it
    return exc


def _some(deaths: Sequence[str], shown: int = 6) -> str:
    """The deaths, joined; past ``shown``, the first and last few and how many between (the error's
    ``deaths`` keeps them all)."""
    if len(deaths) <= shown:
        return "; ".join(deaths)
    half = shown // 2
    return "; ".join([*deaths[:half], f"... {len(deaths) - 2 * half} more ...", *deaths[-half:]])


def timed_out(timeout_s: float, tasks: Tasks, worker_pids: Mapping[int, int | None],
              kept: bool = False, caller: Caller = LOADER, abandoned: Tasks | None = None,
              stopped: Collection[int] = ()) -> WorkerTimeout:
    """torch's "DataLoader timed out after N seconds", plus what was outstanding where, and what
    follows: ``kept``, the persistent workers go on (torch's), else the iterator was shut down;
    ``caller`` names the calls that go on (the loader's, or the device prefetcher's);
    ``abandoned``: tasks of an earlier epoch the workers still run, this epoch's queued behind them;
    ``stopped``: the ids of those workers that were stopped by a signal (``exits.stopped``), said."""
    held = ", ".join(f"worker {w} (pid {p}{f', {STOPPED_WORDS}' if w in stopped else ''})"
                     for w, p in sorted(worker_pids.items()))
    if abandoned:
        held += f", busy with an abandoned epoch's {format_tasks(abandoned)}, this epoch's tasks queued behind"
    follows = (f" The persistent workers were kept: {caller.next} waits for this batch again, and {caller.epoch} "
               "starts the next epoch on them; to kill a worker that hangs, set task_timeout_s." if kept else
               " The loader was shut down cleanly; iterate again to start over, or raise timeout=.")
    msg = (f"DataLoader timed out after {timeout_s} seconds. Outstanding: {format_tasks(tasks)}"
           + (f"; held by {held}" if held else "") + "." + follows)
    return WorkerTimeout(msg, timeout_s=timeout_s, tasks=_attr(tasks))


def hung(worker_id: int, pid: int | None, task: int, indices: Any, deadline_s: float, *,
         starting: bool = False, iterable: bool = False, abandoned: bool = False, stopped: bool = False) -> WorkerHung:
    """A worker past its deadline (``task_timeout_s``, or the start-up deadline), which the loader
    killed; ``abandoned``: the task is of an earlier epoch (a persistent worker kept after a timeout);
    ``stopped``: it was stopped by a signal as its deadline passed (``exits.stopped``), so not slow:
    said, or the user looks for a slow sample that is not there."""
    held = f"task {task} (sample indices {format_indices(indices)})" + (
        " of an earlier epoch, abandoned (the tasks of this one queued behind it)" if abandoned else "")
    if starting:
        what = (f"more than {deadline_s} seconds on start-up (loading the dataset, seeding, running "
                f"worker_init_fn; the start-up deadline is max(task_timeout_s, {START_TIMEOUT_FLOOR_S})) before "
                f"it could take {held}")
    else:
        what = f"more than task_timeout_s={deadline_s} seconds on {held}"
    advice = ("A worker of an IterableDataset cannot be restarted." if iterable else
              "Pass on_worker_death='restart' to retry the task in a new worker, or raise task_timeout_s "
              "(SHMLOADER_TASK_TIMEOUT_S).")
    how = f"; it was {STOPPED_WORDS} and could not run" if stopped else ""
    msg = f"DataLoader worker {worker_id} (pid {pid}) spent {what} and was killed with SIGKILL{how}. {advice}"
    return WorkerHung(msg, timeout_s=deadline_s, tasks={task: plain_indices(indices)}, worker_id=worker_id, pid=pid)


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``: what a later error says of ``exc`` without holding it
    (an exception keeps its traceback, and the traceback the frames that may view a slot)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def stopped_after(iterator: str, cause: str, caller: Caller = LOADER) -> LoaderError:
    """``next()`` on an iterator that a fault shut down: never a quiet end of the epoch, whose
    batches not handed out were lost with the workers. ``cause`` is :func:`first_line` of the fault;
    ``caller`` names the call that starts an epoch (the loader's, or the device prefetcher's)."""
    return LoaderError(f"this {iterator} stopped at an earlier error ({cause}) and shut its workers down: the "
                       "batches of this epoch it had not handed out were not loaded. Start a new epoch with "
                       f"{caller.epoch}.")


_OOM_KILLS_AT_START = _cgroup_oom_kills()


def worker_exception(msg: Any, worker_id: int, pid: int | None, rec: Any) -> BaseException:
    """A worker's ``Failed`` reply as the exception the caller gets: its own type where that can be
    rebuilt here, torch's words, and the worker, pid, task and sample indices (``rec``: the task's
    record, None for a failure outside a task)."""
    return rebuild_worker_exception(exc_types.loads(msg.exc_type), msg.type_name, msg.traceback,
                                    worker_id=worker_id, pid=pid, task=None if rec is None else rec.task,
                                    indices=None if rec is None else rec.indices)
