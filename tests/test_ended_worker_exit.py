"""An IterableDataset's worker whose share of the epoch has ended: it exits at once, as torch's.

torch 2.13 (``_MultiProcessingDataLoaderIter._next_data``), without persistent workers, tells a
worker to exit (``_mark_worker_as_unavailable``: a ``None`` on its index queue) as soon as the main
process reads its ``_IterableDatasetStopIteration``; the process ends mid-epoch while the other
workers go on, and the epoch is whole. With persistent workers it is only marked ended, and kept
for the next epoch. Both sides are run here, side by side.

shmloader used to keep the ended worker's process until the epoch ended. It is now told to exit
once its end is read, and reaped when its exit is seen: no death, no restart, nothing left.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import psutil
import pytest

import ended_datasets as ed
import fault_datasets as fd
from adv2_helpers import exited_within
from engine_datasets import BigStream
from iter_helpers import mp_iter
from shmloader import DataLoader
from shmloader.engine.mp_iterator import MultiProcessIter

N = 40
SHORT = 2  # worker 0's share: samples 0 and 2, one batch of two; worker 1's: 1, 3, ... 39


def every_sample() -> list[int]:
    return sorted([0, 2, *range(1, N, 2)])


def _exited(w: Any) -> bool:
    """Whether worker handle ``w``'s process has exited (reaped already, or within 10 s)."""
    return bool(w.retired or exited_within(w.exit_fd, 10))


def _epoch_watching_worker_0(it: MultiProcessIter) -> tuple[list[int], int, int]:
    """Iterate one epoch; once the main process has read worker 0's end, wait (bounded) for worker
    0's process to exit. The samples, worker 0's pid, and how many batches came after its exit."""

    def exits(w0: Any) -> None:
        assert _exited(w0), f"worker 0 (pid {w0.pid}) still running 10 s after its end was read"
        running = [p.pid for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE]
        assert w0.pid not in running and it._pool.workers[1].pid in running

    return ed.epoch_at_end(it, exits)


def _torch_order(in_order: bool = True) -> list[int]:
    """torch's samples, in its order, for the same stream and loader arguments (fork)."""
    torch_data: Any = pytest.importorskip("torch.utils.data")
    loader = torch_data.DataLoader(ed.torch_uneven(N, SHORT), batch_size=2, num_workers=2,
                                   multiprocessing_context="fork", in_order=in_order)
    return [f for b in loader for f in ed.firsts(b)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_whose_share_ended_exits_while_the_others_go_on(method: str) -> None:
    loader: DataLoader[Any] = DataLoader(fd.UnevenStream(N, short=SHORT), batch_size=2, num_workers=2,
                                         multiprocessing_context=method)
    it = mp_iter(iter(loader))
    got, pid, after = _epoch_watching_worker_0(it)
    assert after >= 3, "worker 1 had batches left after worker 0's exit"
    assert got == _torch_order()  # every sample once, in torch's order
    stats = loader.stats()
    assert (stats["worker_deaths"], stats["worker_restarts"]) == (0, 0)  # an exit asked for: no death
    assert it.closed
    assert not psutil.pid_exists(pid) or psutil.Process(pid).ppid() != os.getpid()  # reaped: no zombie


@pytest.mark.timeout(60)
def test_out_of_order_the_ended_worker_exits_too() -> None:
    loader: DataLoader[Any] = DataLoader(fd.UnevenStream(N, short=SHORT), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork", in_order=False)
    got, _pid, after = _epoch_watching_worker_0(mp_iter(iter(loader)))
    assert after >= 3
    assert sorted(got) == sorted(_torch_order(in_order=False)) == every_sample()
    assert loader.stats()["worker_deaths"] == 0


@pytest.mark.timeout(60)
def test_the_exit_is_one_info_record_and_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    loader: DataLoader[Any] = DataLoader(fd.UnevenStream(N, short=SHORT), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork")
    with caplog.at_level(logging.INFO, logger="shmloader"):
        _got, pid, _after = _epoch_watching_worker_0(mp_iter(iter(loader)))
    # logged as the wait reaps it mid-epoch: one left to the epoch's shutdown is logged there, in other words
    about = [r for r in caplog.records if f"pid {pid}" in r.getMessage() and "started" not in r.getMessage()]
    assert [(r.levelno, "share of the epoch had ended" in r.getMessage()) for r in about] == [(logging.INFO, True)]


@pytest.mark.timeout(60)
def test_a_persistent_worker_whose_share_ended_stays_and_serves_the_next_epoch() -> None:
    """As torch's (below): marked ended, kept alive, the next epoch's share read by the same process."""
    loader: DataLoader[Any] = DataLoader(fd.UnevenStream(N, short=SHORT), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork", persistent_workers=True)
    with loader:
        it = mp_iter(iter(loader))

        def stays(w0: Any) -> None:
            assert w0.running and not w0.retired

        got, pid, _after = ed.epoch_at_end(it, stays)
        assert pid and sorted(got) == every_sample()
        assert it._pool.workers[0].running
        assert sorted(f for b in loader for f in ed.firsts(b)) == every_sample()
        assert it._pool.workers[0].pid == pid
        assert loader.stats()["worker_deaths"] == 0


@pytest.mark.timeout(60)
def test_torch_persistent_worker_stays_after_its_end() -> None:
    torch_data: Any = pytest.importorskip("torch.utils.data")
    loader = torch_data.DataLoader(ed.torch_uneven(N, SHORT), batch_size=2, num_workers=2,
                                   multiprocessing_context="fork", persistent_workers=True)
    it = iter(loader)
    while it._workers_status[0]:
        next(it)
    pid = it._workers[0].pid
    [next(it) for _ in range(3)]
    assert os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None  # not exited
    assert sorted(f for b in loader for f in ed.firsts(b)) == every_sample()
    assert it._workers[0].pid == pid
    it._shutdown_workers()


@pytest.mark.timeout(120)
def test_a_batch_kept_for_a_growing_slot_is_delivered_before_its_worker_is_let_go(tmp_path: Path) -> None:
    """Each worker's last batch is too big for its slot; the worker keeps it, its share then ends,
    and the retry in the grown slot is sent after the task that found the end. Read with that end,
    the retry is still the worker's to answer. Passed over with the tasks dealt after the end (as
    the worker's exit first did, and as a death after the end still did), its samples were lost,
    in most epochs, as timing went (tests/test_growth.py saw it)."""
    for epoch in range(8):
        log = tmp_path / f"drawn{epoch}"
        got = list(DataLoader(BigStream(16, 1 << 17, str(log)), batch_size=4, num_workers=2,
                              multiprocessing_context="fork"))
        assert sorted(y for b in got for y in b["y"].tolist()) == list(range(16)), f"epoch {epoch}"
