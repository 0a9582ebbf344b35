"""A worker of an IterableDataset that dies after its share of the epoch ended.

torch 2.13, once the main process reads a worker's ``_IterableDatasetStopIteration``, tells that
worker to exit (without persistent workers): by the time a trainer or an OOM killer could kill it,
it has exited by itself (exit code 0), and the epoch ends with every batch and no error. With
persistent workers it is kept, its status False; killed then, torch's SIGCHLD handler raises
``RuntimeError: DataLoader worker (pid N) is killed by signal: Killed.`` in the main thread at once
(from another thread, which has no such handler, the epoch ends whole and the next ``iter()``
raises ``DataLoader worker (pid(s) N) exited unexpectedly``). Both sides are run here.

shmloader kept an ended worker until the epoch ended; without persistent workers its death used to
end the epoch with ``WorkerDied`` though nothing was lost. It is now let go (``deaths.py``): the
epoch goes on, each batch once, under either ``on_worker_death`` policy, and a task dealt to it
after its end, whose answer it never gave, is passed over as its ``Exhausted`` would have been.
Such a worker is now also told to exit once its end is read, as torch's is
(tests/test_ended_worker_exit.py); the deaths here are made while its exit is held (``HeldExit``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from typing import Any

import pytest

import ended_datasets as ed
import fault_datasets as fd
from adv2_helpers import kill_and_wait
from iter_helpers import mp_iter
from shmloader import DataLoader, WorkerDied

N = 40
SHORT = 2  # worker 0's share: samples 0 and 2, one batch of two


def every_sample() -> list[int]:
    return sorted([0, 2, *range(1, N, 2)])


def _epoch_killing_worker_0_once_ended(loader: DataLoader[Any]) -> tuple[list[int], int]:
    """Iterate one epoch; SIGKILL worker 0 (and wait for its exit) as soon as the main process has
    read the end of its share, with more batches of worker 1 to come. The samples, and the pid."""
    got, pid, after = ed.epoch_at_end(mp_iter(iter(loader)), kill_and_wait)
    assert after >= 3, "worker 1 had no batch left: nothing would see the death"
    return got, pid


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("policy", ["raise", "restart"])
def test_a_non_persistent_worker_killed_after_its_share_ended_costs_nothing(in_order: bool, policy: str,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Its exit, which the loader asks for once its end is read, is held (``HeldExit``), so the
    kill always finds it running."""
    gate = multiprocessing.get_context("fork").Semaphore(0)
    loader: DataLoader[Any] = DataLoader(ed.HeldExit(N, SHORT, gate), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork", in_order=in_order,
                                         on_worker_death=policy)
    with caplog.at_level(logging.INFO, logger="shmloader"):
        got, pid = _epoch_killing_worker_0_once_ended(loader)
    assert sorted(got) == every_sample()  # each sample once, no error
    about = [r for r in caplog.records if f"pid {pid}" in r.getMessage() and "started" not in r.getMessage()]
    # one record of the death (it used to be a warning and an info about the same event)
    assert [(r.levelno, "died with signal SIGKILL" in r.getMessage()) for r in about] == [(logging.WARNING, True)]
    stats = loader.stats()
    assert stats["worker_deaths"] == 1  # the death was seen, and let go
    assert stats["worker_restarts"] == 0  # nothing to replace: the worker had nothing more to do
    gate.release()  # the next epoch's worker 0 holds its exit too, until the gate opens
    assert sorted(f for b in loader for f in ed.firsts(b)) == every_sample()  # the next epoch as ever


@pytest.mark.timeout(60)
def test_a_death_holding_tasks_dealt_after_its_end_passes_them_over() -> None:
    """Worker 0 is dealt task 4 while it still works out that its share ended (task 2); it answers
    task 2 and exits without reading task 4 (made certain through its stop flag, which the loader
    sets when it stops a worker, and when it reads a worker's end: the worker exits, code 0, before
    its next task). Task 4 used to be waited for (or the death raised); it is passed over, as its
    ``Exhausted`` would have been, and the exit, the one the loader asks for, is no death."""
    ctx = multiprocessing.get_context("fork")
    at_end, gate = ctx.Event(), ctx.Event()
    loader: DataLoader[Any] = DataLoader(ed.GatedEnd(N, SHORT, at_end, gate), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork")
    it = mp_iter(iter(loader))
    got = ed.firsts(next(it))
    assert got == [0, 2]
    w0 = it._pool.workers[0]
    assert [task for _epoch, task in w0.outstanding] == [2, 4]  # task 4 dealt after its end, unanswered
    assert at_end.wait(30), "worker 0 never reached the end of its share"
    assert w0.stop is not None
    w0.stop.set()
    gate.set()
    got += [f for b in it for f in ed.firsts(b)]
    assert sorted(got) == every_sample()
    assert not w0.running and w0.process.exitcode == 0
    assert loader.stats()["worker_deaths"] == 0


@pytest.mark.timeout(60)
def test_a_persistent_worker_killed_after_its_share_ended_is_worker_died_at_once() -> None:
    """As torch's SIGCHLD handler raises it in the main thread (below): the worker is kept for the
    next epoch, which it cannot serve. iter(loader) then starts afresh, where torch's next epoch
    raises "exited unexpectedly"."""
    loader: DataLoader[Any] = DataLoader(fd.UnevenStream(N, short=SHORT), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork", persistent_workers=True)
    with loader:
        with pytest.raises(WorkerDied, match=r"is killed by signal: Killed \(SIGKILL, 9\)") as caught:
            _epoch_killing_worker_0_once_ended(loader)
        assert caught.value.worker_id == 0
        assert sorted(f for b in loader for f in ed.firsts(b)) == every_sample()


def _torch_epoch_to_worker_0_end(persistent: bool) -> tuple[list[int], Any]:
    """torch's loader over the same stream, iterated until torch marked worker 0 ended
    (``_workers_status``): the samples so far, and the iterator."""
    torch_data: Any = pytest.importorskip("torch.utils.data")
    loader = torch_data.DataLoader(ed.torch_uneven(N, SHORT), batch_size=2, num_workers=2,
                                   multiprocessing_context="fork", persistent_workers=persistent)
    it = iter(loader)
    got: list[int] = []
    while it._workers_status[0]:
        got += ed.firsts(next(it))
    return got, it


def _exited(pid: int) -> Any:
    """Wait until child ``pid`` has exited, without reaping it (torch's handler reads its status)."""
    exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    assert exited is not None
    return exited


@pytest.mark.timeout(60)
def test_torch_non_persistent_worker_exits_by_itself_once_its_end_is_read() -> None:
    """So a kill from outside finds it gone; the epoch ends whole."""
    got, it = _torch_epoch_to_worker_0_end(persistent=False)
    exited = _exited(it._workers[0].pid)
    assert (exited.si_code, exited.si_status) == (os.CLD_EXITED, 0)
    got += [f for b in it for f in ed.firsts(b)]
    assert sorted(got) == every_sample()
    del it


@pytest.mark.timeout(60)
def test_torch_persistent_worker_killed_after_its_end_raises_from_its_sigchld_handler() -> None:
    """torch's handler raises in the main thread as soon as the death is signalled: here, at the
    latest as the epoch goes on."""
    got, it = _torch_epoch_to_worker_0_end(persistent=True)
    pid = it._workers[0].pid
    with pytest.raises(RuntimeError, match=f"DataLoader worker \\(pid {pid}\\) is killed by signal: Killed"):
        os.kill(pid, signal.SIGKILL)
        _exited(pid)
        got += [f for b in it for f in ed.firsts(b)]
    it._shutdown_workers()
