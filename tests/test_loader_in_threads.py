"""A loader used from a thread other than the main one behaves as it does in the main thread.

torch 2.13 installs its SIGCHLD handler only from the main thread; from any other thread it finds a
dead worker by polling every 5 s (``MP_STATUS_CHECK_INTERVAL``), and an iterable dataset's dead
worker may surface as ``ConnectionResetError`` or ``EOFError`` there. shmloader installs no signal
handler: it waits on each worker's pidfd (or sentinel) from whichever thread runs ``next()``, so a
fault reaches that thread at once, with the type and words it has in the main thread. Checked here:

- a dataset that raises, and a worker SIGKILLed from the dataset or from outside, for a loader
  made in the main thread and iterated in another, or made and iterated in another (map and
  iterable datasets, persistent workers on and off): same error type and first line as in the
  main thread (the pid aside), nothing left behind;
- a Ctrl-C to the process while a thread iterates: the main thread gets ``KeyboardInterrupt``
  (as with torch), the thread's epochs go on whole, each batch once;
- a batch one thread holds (as the array, a sub-view, or a torch tensor over it) while another
  thread runs the iterator on for more epochs: never written again.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Callable
from typing import Any

import fault_datasets as fd
from iter_helpers import mp_iter
import numpy as np
import pytest
from process_helpers import within, workers_left

from shmloader import DataLoader

DEADLINE_S = 30.0


def _dataset(kind: str, how: str) -> Any:
    if kind == "map":
        return fd.FaultyDataset(16, where="getitem", how=how, at=5)
    return fd.FaultyStream(16, 5, how)


def _in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a new (daemon) thread: its result or its error; fails if it has not ended in time."""
    return within(fn, DEADLINE_S)


def _words_of(fn: Callable[[], Any]) -> tuple[type, str]:
    """The type and first line of the error ``fn()`` raises, pids blanked (each run has its own
    workers) and without the other tasks the dead worker held (how many it had been sent by then
    is the scheduler's). Only these are kept: as with torch, a worker's exception leaves its iterator usable,
    and the error's traceback would keep that iterator, and its workers, alive."""
    try:
        fn()
    except Exception as exc:  # the error under test
        line = re.sub(r"(; it also held .*|\.)$", "", str(exc).splitlines()[0])
        return type(exc), re.sub(r"pid \d+", "pid N", line)
    raise AssertionError(f"{fn} raised nothing")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_fault_reaches_a_thread_as_it_reaches_the_main_thread(how: str, kind: str, persistent: bool) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(_dataset(kind, how), batch_size=2, num_workers=2, persistent_workers=persistent,
                          multiprocessing_context="fork")

    in_main = _words_of(lambda: list(make()))
    made_here = make()
    try:
        from_thread = _words_of(lambda: _in_thread(lambda: list(made_here)))  # made in this thread, run in another
    finally:
        made_here.close()
    made_there = _words_of(lambda: _in_thread(lambda: list(make())))  # made and run in another thread
    assert from_thread == in_main == made_there  # not signal's "signal only works in main thread" either
    assert issubclass(in_main[0], fd.Boom if how == "raise" else RuntimeError)
    assert workers_left(zombies=True) == []


@pytest.mark.timeout(60)
def test_a_worker_killed_from_outside_while_a_thread_waits_for_it() -> None:
    loader: DataLoader[Any] = DataLoader(fd.HangsAt(16, at=2), batch_size=2, num_workers=1,
                                         multiprocessing_context="fork")
    it = mp_iter(iter(loader))
    assert np.asarray(next(it))[0].tolist() == fd.sample(0).tolist()
    pid = it._pool.workers[0].pid
    waiting = threading.Event()

    def next_then_kill() -> Any:
        waiting.set()
        return next(it)  # waits for sample 2, which hangs: only the kill below ends the wait

    def kill_once_waiting() -> None:
        if waiting.wait(DEADLINE_S):
            os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_waiting, daemon=True)
    killer.start()
    with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid {pid}\) is killed by signal: Killed"):
        _in_thread(next_then_kill)
    killer.join(DEADLINE_S)
    loader.close()
    assert workers_left(zombies=True) == []


class Full:
    """Sample ``i`` is 64 copies of ``i`` (int64)."""

    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(64, i, np.int64)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_a_ctrl_c_in_the_main_thread_leaves_a_thread_s_epochs_whole(num_workers: int, persistent: bool) -> None:
    """torch 2.13: the main thread gets KeyboardInterrupt; the thread's epochs go on (checked alike)."""
    loader: DataLoader[Any] = DataLoader(Full(), batch_size=2, num_workers=num_workers, persistent_workers=persistent)
    first, done = threading.Event(), threading.Event()
    got: list[int] = []

    def run() -> None:
        for _epoch in range(2):
            for batch in loader:
                got.append(int(batch[0, 0]))
                first.set()
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert first.wait(DEADLINE_S)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: Python's handler raises in the main thread
        done.wait(DEADLINE_S)
    assert done.wait(DEADLINE_S), "the thread's epochs did not end"
    thread.join(DEADLINE_S)
    assert got == list(range(0, 200, 2)) * 2
    loader.close()
    assert workers_left(zombies=True) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("held_as", ["array", "subview", "tensor"])
@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_a_batch_held_in_one_thread_is_never_written_while_another_runs_on(num_workers: int, persistent: bool,
                                                                           held_as: str) -> None:
    if held_as == "tensor":
        torch = pytest.importorskip("torch")
    loader: DataLoader[Any] = DataLoader(Full(), batch_size=4, num_workers=num_workers, persistent_workers=persistent)
    it = iter(loader)
    batch = next(it)
    held = {"array": batch, "subview": batch[1:2, 3:9]}.get(held_as)
    if held_as == "tensor":
        held = torch.from_numpy(batch)
    expected = np.asarray(held).copy()
    del batch  # the held view alone keeps the slot
    stop, changed = threading.Event(), threading.Event()

    def watch() -> None:
        while not stop.is_set() and not changed.is_set():
            if not np.array_equal(np.asarray(held), expected):
                changed.set()

    def run_on() -> None:
        for _ in it:  # this epoch's other slots are released and reused meanwhile
            pass
        for _epoch in range(2):
            for _ in loader:
                pass

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        _in_thread(run_on)
    finally:
        stop.set()
        watcher.join(DEADLINE_S)
    assert not changed.is_set() and np.array_equal(np.asarray(held), expected)
    loader.close()
    assert np.array_equal(np.asarray(held), expected)  # and after close(), while still held
