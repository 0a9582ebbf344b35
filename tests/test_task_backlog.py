"""Tasks larger than a pipe holds: the main process never blocks writing to a worker.

A task's frame carries its sample indices; 40,000 of them (or a few hundred file paths) are more
than the 64 KiB a pipe holds, and a worker reads its task pipe only between tasks. The main
process writes what the pipe takes and keeps the rest, in order, in the worker's outbox
(``WorkerHandle.send_frame``), written as the pipe drains while it polls: so ``timeout=``, the
per-task deadline and ``close()`` from another thread still act while a worker is busy, and a
stop message queued behind a task never blocks ``shutdown``.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from shmloader import DataLoader, LoaderClosed, WorkerTimeout
from shmloader.engine.workers import WorkerHandle
from shmloader.transport import wire
from shmloader.transport.messages import Detach

BATCH = 40_000  # the indices of one task pickle to ~120 KB: about twice what a pipe holds


class SlowFirst:
    """Sample 0 takes ``sleep_s``; the others are their index."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return 4 * BATCH

    def __getitem__(self, i: int) -> int:
        if i == 0:
            time.sleep(self.sleep_s)
        return i


class HangOnce(SlowFirst):
    """Sample 0 hangs in the first worker that fetches it (a marker file says it did)."""

    def __init__(self, marker: str) -> None:
        super().__init__(0.0)
        self.marker = marker

    def __getitem__(self, i: int) -> int:
        if i == 0:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return i
            time.sleep(60)
        return i


@pytest.mark.timeout(60)
def test_timeout_fires_while_a_busy_worker_has_a_large_task_unread():
    loader = DataLoader(SlowFirst(20), batch_size=BATCH, num_workers=1, timeout=1, multiprocessing_context="fork")
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerTimeout, match="timed out after 1"):
            next(iter(loader))
        assert time.monotonic() - t0 < 10  # not the 20 s the first sample takes
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_a_hung_worker_with_a_large_task_unread_is_killed_and_its_tasks_rerun(tmp_path):
    loader = DataLoader(HangOnce(str(tmp_path / "hung")), batch_size=BATCH, num_workers=1, task_timeout_s=1,
                        on_worker_death="restart", multiprocessing_context="fork")
    try:
        firsts = [int(b[0]) for b in loader]
    finally:
        loader.close()
    assert firsts == [0, BATCH, 2 * BATCH, 3 * BATCH]  # every batch once, in order, after the restart


@pytest.mark.timeout(60)
def test_close_from_another_thread_while_a_large_task_waits_to_be_written():
    loader = DataLoader(SlowFirst(20), batch_size=BATCH, num_workers=1, multiprocessing_context="fork")
    it = iter(loader)
    caught: list[BaseException] = []

    def consume() -> None:
        try:
            next(it)
        except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
            caught.append(exc)

    t = threading.Thread(target=consume)
    t.start()
    while not loader_is_waiting(it):  # bounded by the test's timeout
        time.sleep(0.01)
    t0 = time.monotonic()
    loader.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 10
    assert len(caught) == 1 and isinstance(caught[0], LoaderClosed)


def loader_is_waiting(it: object) -> bool:
    """True once the iterator has sent its tasks (some of them still in an outbox) and waits."""
    pool = getattr(it, "_pool", None)
    return bool(pool and pool.backlog)


@pytest.mark.timeout(30)
def test_the_outbox_keeps_frames_whole_and_in_order():
    r, w = os.pipe()
    handle = WorkerHandle(0, None, _FdConn(w), _FdConn(r), backlog=set())
    big = [wire.task_frame(0, t, list(range(BATCH)), 0, "shml_x", 1 << 20, None) for t in range(3)]
    for frame in big:
        handle.send_frame(frame)  # never blocks: the pipe takes ~64 KiB, the outbox the rest
    handle.send(Detach(("shml_y",)))
    assert handle.backlog == {handle}
    reader, got = wire.FrameReader(r), []
    while len(got) < 4:
        got += reader.read()
        handle.flush()
    assert got[:3] == big and wire.decode(got[3]) == Detach(("shml_y",))
    assert not handle.backlog and not handle.unsent
    os.close(r)
    with pytest.raises(BrokenPipeError):  # the reader is gone: the caller's sentinel tells the rest
        handle.send_frame(big[0])
    assert not handle.unsent and not handle.backlog
    os.close(w)


@pytest.mark.timeout(30)
def test_a_flush_to_a_closed_pipe_drops_the_outbox():
    r, w = os.pipe()
    handle = WorkerHandle(0, None, _FdConn(w), _FdConn(r), backlog=set())
    handle.send_frame(wire.task_frame(0, 0, list(range(BATCH)), 0, "shml_x", 1 << 20, None))
    assert handle.unsent
    os.close(r)
    with pytest.raises(OSError):
        handle.flush()
    assert not handle.unsent and not handle.backlog  # a dead worker's tasks are the sentinel's business
    os.close(w)


class _FdConn:
    """The two methods of ``multiprocessing.connection.Connection`` a handle's pipes are used through."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        pass
