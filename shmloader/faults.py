"""The fault policy: what a worker death, a hang or a timeout becomes.

Owns the decision (raise, or restart the worker and re-dispatch its tasks; when a task is poison;
when the restart budget is spent) and the wording of every such error. Pure apart from reading
measurements for hints (free bytes of the shm directory, the cgroup's OOM-kill count). Runs in the
main process. Messages keep torch's words where users grep for them ("DataLoader worker ...
exited unexpectedly", "DataLoader timed out after N seconds") and add the facts torch leaves out.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .errors import (
    PoisonTask,
    RestartBudgetExceeded,
    WorkerDied,
    WorkerHung,
    WorkerTimeout,
    describe_exit,
    format_indices,
    format_tasks,
)

Tasks = Mapping[int, Sequence[int] | None]


@dataclass(frozen=True)
class FaultPolicy:
    on_worker_death: str = "raise"  # "raise" | "restart"
    max_restarts: int = 16
    max_task_attempts: int = 3
    task_timeout_s: float = 0.0

    @property
    def restart(self) -> bool:
        return self.on_worker_death == "restart"


def hints(shm_dir: str, exitcode: int | None) -> list[str]:
    """Guesses about a death, each backed by a measurement; empty when nothing points anywhere."""
    found: list[str] = []
    if exitcode == -signal.SIGKILL:
        oom = _cgroup_oom_kills()
        if oom:
            found.append(f"hint: the cgroup's memory.events counts {oom} OOM kill(s); the worker may have "
                         "run out of memory")
    if exitcode == -signal.SIGBUS:
        free = shm_free_bytes(shm_dir)
        if free is not None:
            found.append(f"hint: SIGBUS often means {shm_dir} ran out of space; it has {free} bytes free now")
    return found


def shm_free_bytes(shm_dir: str) -> int | None:
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _cgroup_oom_kills() -> int:
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


def died(worker_id: int, pid: int | None, exitcode: int | None, tasks: Tasks, shm_dir: str,
         *, iterable: bool = False) -> WorkerDied:
    """torch's "DataLoader worker ... exited unexpectedly", with worker, pid, cause and tasks."""
    lines = [
        f"DataLoader worker {worker_id} (pid(s) {pid}) exited unexpectedly with {describe_exit(exitcode)}.",
        f"It held {format_tasks(tasks)}." if tasks else "It held no task.",
        *hints(shm_dir, exitcode),
    ]
    if iterable:
        lines.append("An IterableDataset worker cannot be restarted: its iterator's position died with it.")
    else:
        lines.append("To replace dead workers and re-run their tasks, pass on_worker_death='restart' "
                     "(or set SHMLOADER_ON_WORKER_DEATH=restart).")
    return WorkerDied("\n".join(lines), worker_id=worker_id, pid=pid, exitcode=exitcode, tasks=tasks)


def budget_spent(worker_id: int, pid: int | None, exitcode: int | None, tasks: Tasks,
                 max_restarts: int) -> RestartBudgetExceeded:
    msg = (f"DataLoader worker {worker_id} (pid(s) {pid}) exited unexpectedly with {describe_exit(exitcode)}, "
           f"and the restart budget of {max_restarts} restarts this epoch is spent. It held "
           f"{format_tasks(tasks)}. Raise max_restarts (SHMLOADER_MAX_RESTARTS) or find what kills workers.")
    return RestartBudgetExceeded(msg, worker_id=worker_id, pid=pid, exitcode=exitcode, tasks=tasks)


def poison(task: int, indices: Sequence[int] | None, attempts: int, deaths: Sequence[str]) -> PoisonTask:
    msg = (f"task {task} (sample indices {format_indices(indices)}) killed its worker on each of "
           f"{attempts} attempts and is not retried again: " + "; ".join(deaths) +
           ". Check those samples; max_task_attempts (SHMLOADER_MAX_TASK_ATTEMPTS) sets the bound.")
    return PoisonTask(msg, task=task, indices=list(indices or []), attempts=attempts, deaths=deaths)


def timed_out(timeout_s: float, tasks: Tasks, worker_pids: Mapping[int, int | None]) -> WorkerTimeout:
    """torch's "DataLoader timed out after N seconds", plus what was outstanding where."""
    held = ", ".join(f"worker {w} (pid {p})" for w, p in sorted(worker_pids.items()))
    msg = (f"DataLoader timed out after {timeout_s} seconds. Outstanding: {format_tasks(tasks)}"
           + (f"; held by {held}" if held else "") + ". The loader was shut down cleanly; iterate again "
           "to start over, or raise timeout=.")
    return WorkerTimeout(msg, timeout_s=timeout_s, tasks=tasks)


def hung(worker_id: int, pid: int | None, task: int, indices: Sequence[int] | None,
         deadline_s: float) -> WorkerHung:
    msg = (f"DataLoader worker {worker_id} (pid {pid}) spent more than task_timeout_s={deadline_s} "
           f"seconds on task {task} (sample indices {format_indices(indices)}) and was killed. "
           "Pass on_worker_death='restart' to retry the task in a new worker.")
    return WorkerHung(msg, timeout_s=deadline_s, tasks={task: list(indices or [])}, worker_id=worker_id, pid=pid)
