"""A child that user code forks inside a worker and that comes back into the worker's code never
answers for the worker.

The defect: a dataset (or ``worker_init_fn``) that forks, and whose child does not end with
``os._exit`` — it returns, or an exception climbs out of it — continued in the child as a second
copy of the worker: it sent its exception as the task's reply (the main process raised it though
the worker itself delivered the batch), and it read tasks off the worker's pipe and answered them
too. Such a child now exits before it sends or reads anything (``shmloader/worker/main.py``,
``lineage.leave_if_forked``), and says so on stderr; the worker goes on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import procs_datasets as pd
import psutil
import pytest
from process_helpers import until

from shmloader import DataLoader


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_exception_escaping_a_forked_child_is_not_the_tasks_error(method: str, tmp_path: Path,
                                                                       capfd: pytest.CaptureFixture[str]) -> None:
    loader: DataLoader[Any] = DataLoader(pd.ForkChildEscapes(3, str(tmp_path)), batch_size=2, num_workers=2,
                                         multiprocessing_context=method)
    try:
        batches = [b.tolist() for b in loader]
    finally:
        loader.close()
    assert [[row[0] for row in b] for b in batches] == [[i, i + 1] for i in range(0, pd.N, 2)]
    (escaped,) = pd.noted_pids(str(tmp_path), "escaped")
    assert escaped not in {row[1] for b in batches for row in b}  # every sample came from a worker
    assert (tmp_path / "status").read_text() == "1"  # it exited, as an uncaught exception would
    err = capfd.readouterr().err
    assert "ValueError: raised in a child forked by the dataset" in err
    assert f"shmloader: process {escaped}, forked inside DataLoader worker" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_child_of_worker_init_fn_that_returns_takes_no_task(method: str, tmp_path: Path) -> None:
    loader: DataLoader[Any] = DataLoader(pd.Pids(), batch_size=2, num_workers=2,
                                         worker_init_fn=pd.InitForkReturns(str(tmp_path)),
                                         multiprocessing_context=method)
    try:
        batches = [b.tolist() for b in loader]
    finally:
        loader.close()
    (escaped,) = pd.noted_pids(str(tmp_path), "escaped")
    assert [row[0] for b in batches for row in b] == list(range(64))
    assert escaped not in {row[1] for b in batches for row in b}
    # it exits as it comes back (reaped by its parent's parent once the worker exited); under load
    # its exit may still be under way as the epoch ends, so it is given a deadline, not a moment
    assert until(lambda: _exited(escaped), 10), psutil.Process(escaped).status()


def _exited(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
