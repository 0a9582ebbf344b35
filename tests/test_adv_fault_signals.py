"""A signal other than SIGKILL sent to one worker from outside, while it runs a task.

A fatal signal (SIGTERM: a scheduler or an operator; SIGHUP; SIGQUIT; SIGABRT; SIGUSR1 with no
handler) ends the worker at its default action, whatever handler a forked worker inherited from
the trainer: ``WorkerDied`` names the signal by name and number, the worker and its pid, and the
task it ran; under the restart policy the task is re-run and the epoch has every batch once.
torch 2.13, run side by side (2 workers, SIGTERM to the worker inside sample 5), raises
``DataLoader worker (pid(s) N) exited unexpectedly``, naming no signal.

SIGINT is the trainer's: a worker ignores it (Ctrl-C reaches the whole process group, and the main
process stops the workers), so a SIGINT to one worker alone changes nothing: the epoch has every
batch once. torch's worker ends at the KeyboardInterrupt, and its main process then fails (run side
by side: a ``FileNotFoundError`` from multiprocessing's resource sharer).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from adv2_helpers import exited_within
from adv_fault_datasets import Gate, StopsAt
from shmloader import DataLoader, WorkerDied
from test_adv2_exactly_once import firsts

N = 12

FATAL = [signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGABRT, signal.SIGUSR1]


def epoch_with_signal(tmp_path: Any, sig: int, policy: str) -> tuple[list[int], int, DataLoader[Any]]:
    """One epoch; ``sig`` is sent to the worker inside sample 5 as it gets there. Returns the
    samples delivered, that worker's pid and the loader (closed)."""
    gate = Gate()
    loader: DataLoader[Any] = DataLoader(StopsAt(N, 5, gate, str(tmp_path)), batch_size=2, num_workers=2,
                                         on_worker_death=policy)
    got: list[int] = []
    try:
        with loader:
            it = iter(loader)
            got += firsts([next(it)])  # the workers run: worker 0 reaches sample 5 in its second task
            pid = gate.wait()
            os.kill(pid, sig)
            if sig != signal.SIGINT:
                fd = os.pidfd_open(pid)
                try:
                    assert exited_within(fd, 10), f"worker {pid} outlived {signal.Signals(sig).name}"
                finally:
                    os.close(fd)
            else:  # an ignored signal is dropped as it is sent (signal(7)): nothing is pending now
                gate.release()
            for b in it:
                got += firsts([b])
    finally:
        gate.close()
    return got, pid, loader


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", FATAL, ids=lambda s: signal.Signals(s).name)
def test_a_fatal_signal_to_a_worker_is_named_in_the_error(tmp_path: Any, sig: int) -> None:
    with pytest.raises(WorkerDied) as err:
        epoch_with_signal(tmp_path, sig, "raise")
    name = signal.Signals(sig).name
    assert err.value.signal == sig
    assert f"({name}, {int(sig)})" in str(err.value)
    assert "Worker 0 died while running task 2 (sample indices [4..5])" in str(err.value)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", FATAL, ids=lambda s: signal.Signals(s).name)
def test_a_fatal_signal_to_a_worker_is_survived_under_restart(tmp_path: Any, sig: int) -> None:
    got, _pid, loader = epoch_with_signal(tmp_path, sig, "restart")
    assert got == list(range(N))
    assert loader.stats()["worker_restarts"] == 1


@pytest.mark.timeout(30)
def test_sigint_to_one_worker_is_ignored_and_the_epoch_is_whole(tmp_path: Any) -> None:
    got, pid, loader = epoch_with_signal(tmp_path, signal.SIGINT, "raise")
    assert got == list(range(N))
    assert loader.stats()["worker_restarts"] == 0
