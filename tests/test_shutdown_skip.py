"""A worker starts no task once the main process has begun to stop it (torch's ``done_event``).

torch's worker loop skips every index still queued once shutdown begins, so ``close()`` waits at
most for the task each worker is running. Ours used to run every task already in its task pipe
(up to ``prefetch_factor``) before it read the stop message: ``close()`` waited for ``__getitem__``
calls whose batches nobody would get, up to the join's grace and then SIGTERM.

The dataset records each index it starts in a file per worker and blocks its first index until
the test creates a gate file. Worker 0 holds that index and one more task queued behind it;
worker 1 finishes its two tasks and waits. Once ``close()`` is under way worker 1 (idle) reads its
stop message and exits, which is strictly after every worker was told to stop; only then is the
gate opened. Worker 0 must then finish its running index and start no other.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from iter_helpers import mp_iter
import psutil
import pytest
from process_helpers import until

from shmloader import DataLoader

GATE_WAIT_S = 20.0


class GatedDataset:
    """Index ``i`` is ``i``; each start is appended to ``<log_dir>/<pid>``; index 0 waits for the gate."""

    def __init__(self, log_dir: str, n: int = 16) -> None:
        self.log_dir = log_dir
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        with open(os.path.join(self.log_dir, str(os.getpid())), "a") as f:
            f.write(f"{i}\n")
        if i == 0:
            gate = os.path.join(self.log_dir, "gate")
            end = time.monotonic() + GATE_WAIT_S
            while not os.path.exists(gate) and time.monotonic() < end:
                time.sleep(0.005)  # polled: the test opens the gate when close() is under way
        return i


def started(log_dir: str) -> dict[int, list[int]]:
    """pid -> the indices that worker started, in order."""
    out: dict[int, list[int]] = {}
    for name in os.listdir(log_dir):
        if name.isdigit():
            with open(os.path.join(log_dir, name)) as f:
                out[int(name)] = [int(line) for line in f.read().split()]
    return out


def gone(pid: int) -> bool:
    """The process has exited (a zombie not reaped yet counts: it runs nothing any more)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _open_gate_when(log_dir: str, idle_pid: int) -> threading.Thread:
    """Open the gate once the idle worker has exited: it did so on its stop message, which comes
    after every worker of the pool was told to stop."""
    def run() -> None:
        if until(lambda: gone(idle_pid), 15.0):
            open(os.path.join(log_dir, "gate"), "w").close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _stop(loader: DataLoader, it: Any, how: str) -> None:
    """Begin the stop; for "del" the test's own ``del it`` (its last reference) is the stop."""
    if how == "close":
        it.close()
    elif how == "loader.close":
        loader.close()  # persistent workers: the loader owns the iterator


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context, how", [("fork", "close"), ("fork", "del"), ("fork", "loader.close"),
                                          ("spawn", "close")])
def test_a_stop_starts_no_queued_task(tmp_path: Any, context: str, how: str) -> None:
    log_dir = str(tmp_path)
    loader: DataLoader[Any] = DataLoader(GatedDataset(log_dir), batch_size=None, num_workers=2, prefetch_factor=2,
                                         multiprocessing_context=context, persistent_workers=how == "loader.close")
    it = mp_iter(iter(loader))
    handles = list(it._pool.workers)
    w0, w1 = (h.pid for h in handles)
    # worker 0 runs index 0 (blocked) with index 2 queued; worker 1 ran 1 and 3 and waits
    assert until(lambda: started(log_dir).get(w0) == [0] and started(log_dir).get(w1) == [1, 3], 30.0), \
        started(log_dir)
    opener = _open_gate_when(log_dir, w1)
    t0 = time.monotonic()
    _stop(loader, it, how)
    del it  # "del": the iterator's finalizer closes it
    elapsed = time.monotonic() - t0
    opener.join(5.0)
    assert os.path.exists(os.path.join(log_dir, "gate")), "worker 1 did not exit on its stop message"
    assert started(log_dir) == {w0: [0], w1: [1, 3]}, "a task queued behind the running one was started after the stop"
    assert [h.process.exitcode for h in handles] == [0, 0], "the stop had to terminate a worker"
    assert elapsed < 5.0, f"the stop took {elapsed:.1f} s: it waited for its grace to run out"


class _GateOnSigterm:
    """``worker_init_fn``: SIGTERM opens the gate and the worker carries on (a handler of the user's)."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir

    def __call__(self, worker_id: int) -> None:
        gate = os.path.join(self.log_dir, "gate")
        signal.signal(signal.SIGTERM, lambda *_: open(gate, "w").close())


@pytest.mark.timeout(60)
def test_a_reaped_worker_that_outlives_sigterm_starts_no_queued_task(tmp_path: Any) -> None:
    """The reap of a live worker (a restart's ``replace`` reaps the worker it replaces) sets its
    stop flag before SIGTERM: a worker whose own handler survives SIGTERM finishes its task and
    exits, where it used to start the next one queued until SIGKILL came a second later."""
    from shmloader.engine import reaping

    log_dir = str(tmp_path)
    loader: DataLoader[Any] = DataLoader(GatedDataset(log_dir), batch_size=None, num_workers=2, prefetch_factor=2,
                                         multiprocessing_context="fork", worker_init_fn=_GateOnSigterm(log_dir))
    it = mp_iter(iter(loader))
    handle = it._pool.workers[0]
    assert until(lambda: started(log_dir).get(handle.pid) == [0], 30.0), started(log_dir)
    reaping.reap(handle)
    assert os.path.exists(os.path.join(log_dir, "gate")), "the worker never got SIGTERM"
    assert started(log_dir)[handle.pid] == [0], "the reaped worker started a task queued behind the running one"
    assert handle.process.exitcode == 0, "the reaped worker had to be killed"
    it.close()
