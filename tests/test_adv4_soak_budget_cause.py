"""The restart budget spent on workers the loader killed itself says so, with the deadline they passed.

A worker past its deadline (``task_timeout_s``, or the start-up deadline) is SIGKILLed by the loader
and, under ``on_worker_death='restart'``, replaced. When such a kill spent the restart budget, the
``RestartBudgetExceeded`` used to say that the worker "exited unexpectedly with signal SIGKILL" and
to "find what kills workers": the loader itself had killed it, and the deadline to raise went
unnamed. Found by stress/combos.py, where spawned workers of the torch flavour (importing torch) on
a loaded machine passed a short start-up deadline on every start.
"""

from __future__ import annotations

from typing import Any

import pytest

import adv4_soak_datasets as ad
import fault_datasets as fd
from process_helpers import workers_left
from shmloader import DataLoader, RestartBudgetExceeded
from shmloader.engine import faults

DEADLINE_S = 0.3


def budget_error(loader: DataLoader[Any]) -> RestartBudgetExceeded:
    with loader, pytest.raises(RestartBudgetExceeded) as info:
        list(loader)
    assert workers_left() == []
    return info.value


@pytest.mark.timeout(60)
def test_start_up_hangs_that_spend_the_budget_are_named(monkeypatch: Any) -> None:
    monkeypatch.setattr(faults, "START_TIMEOUT_FLOOR_S", DEADLINE_S)  # read by the main process: fork
    loader: DataLoader[Any] = DataLoader(list(range(4)), batch_size=2, num_workers=1, task_timeout_s=DEADLINE_S,
                                         worker_init_fn=ad.hang_in_init, on_worker_death="restart",
                                         max_restarts=1, multiprocessing_context="fork")
    text = str(budget_error(loader))
    assert "max_restarts=1" in text and "while starting" in text
    assert f"hung for more than {DEADLINE_S} s (the start-up deadline, max(task_timeout_s, {DEADLINE_S})) and was " \
        "killed while starting" in text, text
    assert "exited unexpectedly" not in text and "killed by signal" not in text, text
    assert "find what kills workers" not in text, text


@pytest.mark.timeout(60)
def test_task_hangs_that_spend_the_budget_are_named() -> None:
    loader: DataLoader[Any] = DataLoader(fd.HangsAt(4, 0), batch_size=2, num_workers=1, task_timeout_s=DEADLINE_S,
                                         on_worker_death="restart", max_restarts=2, max_task_attempts=10,
                                         multiprocessing_context="fork")
    text = str(budget_error(loader))
    assert "max_restarts=2" in text and "task 0 (sample indices [0..1])" in text, text
    assert f"hung for more than {DEADLINE_S} s (task_timeout_s) and was killed while running task 0" in text, text
    assert "exited unexpectedly" not in text and "killed by signal" not in text, text
    assert "find what kills workers" not in text, text
