"""Asleep, the main process is woken by the worker whose batch is due, and by nothing it can't use.

With in-order delivery, round-robin dispatch and a map-style dataset, a reply from any other worker
can be neither handed out nor answered with a new task, so the wait sleeps on the due batch's reply
pipe, every worker's sentinel and the step guard's pipe (engine/wait.py, ``_head_poller``; issue 16).
A death is still seen at once, whichever worker dies.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import threading

import numpy as np
import pytest

import shmloader

CTX = mp.get_context("fork")


class Gate(shmloader.Dataset):
    """Sample 0 waits for ``gate`` (at most 20 s) and says whether it opened; sample 1 kills its
    worker the first time, when ``kill_flag`` exists."""

    def __init__(self, gate, kill_flag: str = "") -> None:  # noqa: ANN001 - an mp.Event
        self.gate = gate
        self.kill_flag = kill_flag

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> np.ndarray:
        if i == 0:
            return np.array([float(self.gate.wait(20))])
        if i == 1 and self.kill_flag and os.path.exists(self.kill_flag):
            os.unlink(self.kill_flag)
            os._exit(3)
        return np.array([float(i)])


@pytest.mark.timeout(60)
def test_a_reply_of_a_worker_whose_batch_is_not_due_does_not_wake_the_wait():
    gate = CTX.Event()
    loader = shmloader.DataLoader(Gate(gate), batch_size=1, num_workers=2, multiprocessing_context="fork")
    try:
        it = iter(loader)
        it._dispatch()  # tasks 0 and 2 to worker 0 (task 0 waits for the gate), 1 and 3 to worker 1
        other = it._pool.workers[1].results.fileno()
        assert select.select([other], [], [], 30)[0] == [other]  # worker 1 has replied
        poller, _by_fd = it._poller()
        assert other in [fd for fd, _ in poller.poll(0)]  # the full set sees it...
        assert other not in [fd for fd, _ in it._head_poller(poller).poll(0)]  # ...the sleeping one does not
        gate.set()
        got = [b.item() for b in it]
    finally:
        gate.set()
        loader.close()
    assert got == [1.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


class OpenOnRestart:
    def __init__(self, gate) -> None:  # noqa: ANN001 - an mp.Event
        self.gate = gate

    def shmloader_worker_restarted(self, worker_id: int) -> None:
        self.gate.set()


@pytest.mark.timeout(60)
def test_a_death_of_a_worker_whose_batch_is_not_due_is_seen_while_the_wait_sleeps(tmp_path):
    """Batch 0 waits until the main process has replaced worker 1, which died on batch 1."""
    gate = CTX.Event()
    flag = tmp_path / "kill"
    flag.touch()
    loader = shmloader.DataLoader(Gate(gate, str(flag)), batch_size=1, num_workers=2, multiprocessing_context="fork",
                                  on_worker_death="restart", plugins=[OpenOnRestart(gate)])
    try:
        got = [b.item() for b in loader]
    finally:
        gate.set()
        loader.close()
    assert not flag.exists()
    assert got == [1.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # batch 0: the gate opened, not timed out


class Done(shmloader.Dataset):
    """Sample 0 hangs (an event nobody sets: the due batch never comes); sample 3, worker 1's
    second task, sets ``done`` when fetched."""

    def __init__(self, done) -> None:  # noqa: ANN001 - an mp.Event
        self.done = done

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> np.ndarray:
        if i == 0:
            threading.Event().wait(30)
        if i == 3:
            self.done.set()
        return np.array([float(i)])


@pytest.mark.timeout(60)
def test_a_timeout_names_only_the_tasks_still_outstanding_not_replies_left_unread():
    """The sleeping wait leaves worker 1's replies in its pipe; ``timeout=`` must read them before it
    says what was outstanding where, or it blames a worker that finished its tasks long before."""
    done = CTX.Event()
    loader = shmloader.DataLoader(Done(done), batch_size=1, num_workers=2, multiprocessing_context="fork",
                                  timeout=2)
    try:
        it = iter(loader)
        it._dispatch()  # tasks 0 and 2 to worker 0 (task 0 never finishes), 1 and 3 to worker 1
        assert done.wait(30)
        with pytest.raises(shmloader.errors.WorkerTimeout) as info:
            next(it)
    finally:
        loader.close()
    assert set(info.value.tasks) == {0, 2}, info.value.tasks
    assert "worker 0" in str(info.value) and "worker 1" not in str(info.value), str(info.value)
