"""A worker stopped from outside (SIGSTOP: an operator, a debugger, a job-control stop) that the
loader kills at its ``task_timeout_s``.

Before, the error said the worker "spent more than task_timeout_s" on its task, as if the task
itself were slow: a user then looked for a slow sample that was not there. The worker's state (T,
stopped, read from ``/proc/<pid>/stat`` before the kill) is a fact: ``WorkerHung`` now says the
worker was stopped by a signal, and so does the restart policy's account of a death it caused
(``RestartBudgetExceeded``, ``PoisonTask``). A worker that was merely slow is not called stopped.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from adv_fault_datasets import Gate, StopsAt, epoch_error
from shmloader import DataLoader, RestartBudgetExceeded, WorkerHung, WorkerTimeout

STOPPED = "stopped by a signal (SIGSTOP or SIGTSTP"


def raised(tmp_path: Any, how: int | None, error: type[BaseException], **options: Any) -> str:
    """The text of ``error``, raised by an epoch whose worker stops inside sample 5 and gets ``how``
    there (None: it waits there, a slow sample) from a thread of the test."""
    gate = Gate()
    options.setdefault("task_timeout_s", 0.5)
    loader: DataLoader[Any] = DataLoader(StopsAt(12, 5, gate, str(tmp_path)), batch_size=2, num_workers=2, **options)
    return str(epoch_error(loader, gate, lambda pid: None if how is None else os.kill(pid, how), error))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stopped", [True, False], ids=["stopped", "slow"])
def test_a_worker_killed_at_its_deadline_is_said_to_be_stopped_when_it_was(tmp_path: Any, stopped: bool) -> None:
    text = raised(tmp_path, signal.SIGSTOP if stopped else None, WorkerHung)
    assert "spent more than task_timeout_s=0.5 seconds on task 2 (sample indices [4..5])" in text, text
    assert (STOPPED in text) == stopped, text


@pytest.mark.timeout(30)
def test_the_restart_policys_account_of_a_stopped_worker_says_so(tmp_path: Any) -> None:
    text = raised(tmp_path, signal.SIGSTOP, RestartBudgetExceeded, on_worker_death="restart", max_restarts=0)
    assert "hung for more than 0.5 s (task_timeout_s)" in text, text
    assert STOPPED in text, text


@pytest.mark.timeout(30)
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("stopped", [True, False], ids=["stopped", "slow"])
def test_a_timeout_names_the_worker_it_waited_for_as_stopped_when_it_was(tmp_path: Any, stopped: bool,
                                                                         persistent: bool) -> None:
    text = raised(tmp_path, signal.SIGSTOP if stopped else None, WorkerTimeout, timeout=0.5, task_timeout_s=0,
                  persistent_workers=persistent)
    assert text.startswith("DataLoader timed out after 0.5 seconds. Outstanding: task 2: indices [4..5]"), text
    assert (STOPPED in text) == stopped, text
