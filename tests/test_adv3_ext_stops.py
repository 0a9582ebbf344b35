"""Workers stopped or made deaf from outside: SIGSTOP (a job scheduler's suspend, a debugger, a
stray ``kill -STOP``) and a dataset that ignores SIGTERM.

Defects closed here:

- ``close()`` with one worker SIGSTOPped waited the whole 5 s grace for it to exit by itself,
  which a stopped process cannot do; it is now continued as the stop begins, so it reads its stop
  flag and exits at once;
- workers that ignore SIGTERM were escalated one after the other (SIGTERM, a join of
  ``KILL_TIMEOUT_S``, SIGKILL, then the next worker), so ``close()`` took the grace plus
  ``KILL_TIMEOUT_S`` per such worker; they are now signalled together and share one deadline.

Checked, fine: a worker SIGSTOPped mid-epoch is killed at ``task_timeout_s`` (``WorkerHung``, or
its tasks re-run once each under the restart policy), and one continued before its deadline
delivers every batch exactly once, in order.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import adv3_ext_datasets as ds
import psutil
import pytest
from process_helpers import until, workers_left

from shmloader import DataLoader, WorkerHung
from shmloader.engine import reaping

ALL = [[i, i + 1] for i in range(0, ds.N, 2)]


def _first_batch_and_its_worker(loader: DataLoader[Any]) -> tuple[Any, list[int], int]:
    it = iter(loader)
    batch = next(it)
    return it, batch[:, 0].tolist(), int(batch[0, 1])


@pytest.mark.timeout(60)
def test_close_continues_a_stopped_worker_instead_of_waiting_out_the_grace() -> None:
    loader: DataLoader[Any] = DataLoader(ds.Pids(), batch_size=2, num_workers=2)
    it, _, victim = _first_batch_and_its_worker(loader)
    os.kill(victim, signal.SIGSTOP)
    assert until(lambda: psutil.Process(victim).status() == psutil.STATUS_STOPPED, 5.0)
    started = time.monotonic()
    loader.close()
    took = time.monotonic() - started
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
    assert workers_left(zombies=True) == []
    assert took < 2.5, f"close() took {took:.2f} s with a stopped worker (the grace is 5 s)"
    del it


@pytest.mark.timeout(90)
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_workers_that_ignore_sigterm_are_killed_together_not_one_after_another(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reaping, "KILL_TIMEOUT_S", 2.0)
    workers = 3
    loader: DataLoader[Any] = DataLoader(ds.HangsIgnoringSigterm(str(tmp_path)), batch_size=2, num_workers=workers)
    it = iter(loader)
    assert until(lambda: len(ds.noted(str(tmp_path), "hung")) == workers, 30.0)
    started = time.monotonic()
    loader.close()
    took = time.monotonic() - started
    assert workers_left(zombies=True) == []
    # the 5 s grace, then one 2 s escalation for all of them; one after another it was 5 + 3 x 2 s
    assert took < 5.0 + 2.0 + 2.0, f"close() took {took:.2f} s"
    del it


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["raise", "restart"])
def test_a_stopped_worker_is_killed_at_its_task_deadline(policy: str) -> None:
    loader: DataLoader[Any] = DataLoader(ds.Pids(), batch_size=2, num_workers=2, task_timeout_s=1.0,
                                         on_worker_death=policy)
    it, first, victim = _first_batch_and_its_worker(loader)
    os.kill(victim, signal.SIGSTOP)
    got = [first]
    try:
        if policy == "raise":
            with pytest.raises(WorkerHung, match=rf"worker 0 \(pid {victim}\) spent more than task_timeout_s=1.0"):
                for batch in it:
                    got.append(batch[:, 0].tolist())
            assert got == ALL[:len(got)]  # what came before the error came in order
        else:
            got += [batch[:, 0].tolist() for batch in it]
            assert got == ALL
            assert loader.stats()["worker_restarts"] == 1
    finally:
        loader.close()
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE


@pytest.mark.timeout(60)
@pytest.mark.parametrize("task_timeout_s", [0.0, 3.0])  # 0: no deadline
def test_a_worker_stopped_then_continued_before_its_deadline_delivers_each_batch_once(task_timeout_s: float) -> None:
    loader: DataLoader[Any] = DataLoader(ds.Pids(), batch_size=2, num_workers=2, task_timeout_s=task_timeout_s,
                                         on_worker_death="restart")
    it, first, victim = _first_batch_and_its_worker(loader)
    os.kill(victim, signal.SIGSTOP)
    resume = threading.Timer(0.5, os.kill, (victim, signal.SIGCONT))
    resume.start()
    try:
        got = [first] + [batch[:, 0].tolist() for batch in it]
    finally:
        resume.join()
        loader.close()
    assert got == ALL
    assert loader.stats()["worker_restarts"] == 0  # continued in time: nothing re-run, nothing twice
