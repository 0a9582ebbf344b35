"""A trainer that ignores SIGCHLD: its finished workers are never signalled by pid, nor reported alive.

With ``signal(SIGCHLD, SIG_IGN)`` (a server's way to avoid zombies) the kernel reaps each child as
it exits and drops its status, so multiprocessing never learns that a worker exited. Shutdown took
every finished worker for a running one: it sent SIGTERM, SIGCONT and SIGKILL to its pid, which the
kernel may already have given to another process (another job's), and warned that each "did not
exit within 5 s of SIGKILL"; a worker's death was reported as "no exit code (still running)". The
worker's pidfd says that it exited, and signals go through it, so they reach no other process
(``shmloader/engine/exits.py``).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import procs_datasets as pd
import pytest

from shmloader import DataLoader, WorkerDied

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux 5.3, Python 3.9)")


@pytest.fixture
def sigchld_ignored() -> Any:
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, previous)


@pytest.fixture
def signals_sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every signal other than 0 sent by ``os.kill`` or ``signal.pidfd_send_signal``, as (how, signal)."""
    sent: list[tuple[str, int]] = []
    kill, pidfd_send = os.kill, signal.pidfd_send_signal

    def recording_kill(pid: int, sig: int) -> None:
        if sig:
            sent.append(("kill", sig))
        kill(pid, sig)

    def recording_pidfd_send(pidfd: int, sig: int, *args: Any) -> None:
        sent.append(("pidfd", sig))
        pidfd_send(pidfd, sig, *args)

    monkeypatch.setattr(os, "kill", recording_kill)
    monkeypatch.setattr(signal, "pidfd_send_signal", recording_pidfd_send)
    return sent


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_that_finished_are_not_signalled_or_waited_for(method: str, sigchld_ignored: None,
                                                                signals_sent: list[tuple[str, int]],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="shmloader"):
        loader: DataLoader[Any]
        with DataLoader(pd.DiesAt(-1), batch_size=2, num_workers=2, multiprocessing_context=method) as loader:
            batches = [int(b[0, 0]) for b in loader]
    assert batches == list(range(0, pd.N, 2))
    assert signals_sent == []  # each worker took the stop message and exited by itself
    assert "did not exit" not in caplog.text


@pytest.mark.timeout(60)
def test_a_death_is_reported_as_an_exit_whose_status_is_lost(sigchld_ignored: None,
                                                              signals_sent: list[tuple[str, int]]) -> None:
    loader: DataLoader[Any] = DataLoader(pd.DiesAt(9), batch_size=2, num_workers=2, multiprocessing_context="fork")
    try:
        with pytest.raises(WorkerDied, match="exited unexpectedly with an exit status this process cannot learn "
                                             r"\(it ignores SIGCHLD") as info:
            list(loader)
    finally:
        loader.close()
    assert "still running" not in str(info.value)
    assert ("kill", signal.SIGTERM) not in signals_sent and ("kill", signal.SIGKILL) not in signals_sent
