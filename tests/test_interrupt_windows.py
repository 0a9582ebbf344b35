"""A Ctrl-C that lands right after a resource is taken, before its owner has recorded it, still
leaves nothing behind: no lock held, no worker running, no segment in the shm directory.

Python raises a pending SIGINT between bytecodes, typically right after a C call returns (a
lock's ``acquire``, a process's ``start``). An adversarial pass injected ``KeyboardInterrupt`` at
such points (docs/design/shutdown-order.md promises that a Ctrl-C inside ``next()`` is handled,
and docs/design/ownership.md that every resource has one owner) and found these windows:

- the step lock taken by ``next()`` (or ``close()``) but not yet owned: the next ``next()`` hung,
  and ``close()`` gave up after ``CLOSE_WAIT_S`` with the workers still running;
- a worker started but not yet in its pool's list: ``shutdown`` never stopped it;
- a segment created but not yet in the ring: its file stayed in the shm directory;
- a segment's retirement cut short in the pin backend's hook (a slot's replaced segment, or one
  of several at ``close()``): it, and at ``close()`` every later one, stayed in the directory;
- a slot taken out of the ring by ``shrink_to`` before its segment was unlinked: the same.

Each test injects the interrupt at one such point with a stand-in that does the real work first
(takes the real lock, really closes the descriptor, really starts the process, really creates
the segment), then raises.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import fault_datasets as fd
from iter_helpers import mp_iter
import numpy as np
import pytest
from plugin_fixtures import CloseOnBatch
from process_helpers import within, workers_left

from shmloader import DataLoader
from shmloader.engine import stepguard, workers
from shmloader.errors import LoaderClosed
from shmloader.transport import ring as ring_mod

DEADLINE_S = 5.0  # well under stepguard.CLOSE_WAIT_S: a wait that long means the lock was lost


def _loader(tmp_path: Any, **kw: Any) -> DataLoader:
    return DataLoader(np.arange(32), batch_size=2, num_workers=2, shm_dir=str(tmp_path),
                      multiprocessing_context="fork", **kw)


def _within(call: Callable[[], Any], seconds: float = DEADLINE_S) -> Any:
    return within(call, seconds)


class _InterruptAfterTake:
    """The step lock, but its next ``acquire`` takes the real lock and then raises
    ``KeyboardInterrupt``: a Ctrl-C right after the C call returned."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.armed = True

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._real.acquire(blocking, timeout)
        if got and self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


# -- the step lock (engine/stepguard.py, engine/mp_iterator.py) ---------------------------------
@pytest.mark.timeout(60)
def test_a_ctrl_c_right_after_next_takes_the_step_lock_leaves_the_iterator_usable(tmp_path: Any) -> None:
    loader = _loader(tmp_path)
    try:
        it = mp_iter(iter(loader))
        it._guard._lock = _InterruptAfterTake(it._guard._lock)
        with pytest.raises(KeyboardInterrupt):
            next(it)
        assert np.asarray(_within(lambda: next(it))).tolist() == [0, 1]  # nothing was taken from the sampler
        _within(loader.close)
        assert workers_left() == []
        assert list(tmp_path.iterdir()) == []
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_a_ctrl_c_right_after_close_takes_the_step_lock_lets_the_next_close_finish(tmp_path: Any) -> None:
    loader = _loader(tmp_path, persistent_workers=True)
    try:
        it = mp_iter(iter(loader))
        next(it)
        it._guard._lock = _InterruptAfterTake(it._guard._lock)
        with pytest.raises(KeyboardInterrupt):
            it.close()
        _within(it.close)  # took CLOSE_WAIT_S and raised LoaderError while the lost lock was held
        assert workers_left() == []
        with pytest.raises(LoaderClosed):
            _within(lambda: next(it))
    finally:
        loader.close()


def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_step_guard_that_fails_to_finish_its_construction_leaves_no_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(fd: int, blocking: bool) -> None:
        raise KeyboardInterrupt  # a Ctrl-C once the wake-up pipe exists, before the guard does

    before = _open_fds()
    monkeypatch.setattr(os, "set_blocking", interrupted)
    with pytest.raises(KeyboardInterrupt):
        stepguard.StepGuard()
    monkeypatch.undo()
    assert _open_fds() - before == set()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_ctrl_c_while_the_wake_up_pipe_closes_leaves_neither_end_open(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _open_fds()
    guard = stepguard.StepGuard()
    real_close = os.close

    def close_then_interrupt(fd: int) -> None:
        monkeypatch.setattr(os, "close", real_close)  # once
        real_close(fd)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "close", close_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        guard.close_pipe()
    assert _open_fds() - before == set()
    assert guard.wake_fd == -1  # nothing polls, or writes to, a number the process may reuse


@pytest.mark.timeout(60)
def test_a_ctrl_c_in_the_shutdown_a_hooks_close_asked_for_still_gives_the_iterator_back(tmp_path: Any) -> None:
    plugin = CloseOnBatch()  # the shutdown runs as that next() returns, with the step lock held
    plugin.loader = loader = _loader(tmp_path, plugins=[plugin])
    try:
        it = mp_iter(iter(loader))
        next(it)
        process = it._pool.workers[0].process
        join = process.join

        def interrupted_join(timeout: float | None = None) -> None:
            process.join = join  # once: a Ctrl-C during the polite join of that shutdown
            raise KeyboardInterrupt

        process.join = interrupted_join
        with pytest.raises(KeyboardInterrupt):
            next(it)
        assert workers_left() == []
        with pytest.raises(LoaderClosed):  # was LoaderError: "called from inside this iterator's own next()"
            _within(lambda: next(it))
        _within(loader.close)
    finally:
        loader.close()


# -- worker start (engine/workers.py) -----------------------------------------------------------
class _InterruptAtStartLog:
    """The pool's logger, but the line that says a worker started raises ``KeyboardInterrupt``
    once: a Ctrl-C after the worker's process runs, before ``start_all`` (or ``replace``) returns."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.armed = True

    def info(self, msg: str, *args: Any) -> None:
        if self.armed and msg.startswith("worker %d started"):
            self.armed = False
            raise KeyboardInterrupt
        self._real.info(msg, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _assert_no_worker_after(interrupted: Callable[[], Any]) -> None:
    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert workers_left() == []


@pytest.mark.timeout(60)
def test_a_ctrl_c_once_a_worker_runs_but_before_its_start_returns_leaves_no_worker(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers, "logger", _InterruptAtStartLog(workers.logger))
    with _loader(tmp_path) as loader:
        _assert_no_worker_after(lambda: iter(loader))


@pytest.mark.timeout(60)
def test_a_ctrl_c_once_a_restarted_worker_runs_but_before_its_start_returns_leaves_no_worker(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    once = tmp_path / "once"
    once.mkdir()
    dataset = fd.FaultyDataset(16, where="getitem", how="kill", at=4, once_dir=str(once))
    loader: DataLoader[Any]
    with DataLoader(dataset, batch_size=2, num_workers=2, on_worker_death="restart", shm_dir=str(tmp_path),
                    multiprocessing_context="fork") as loader:
        it = iter(loader)
        monkeypatch.setattr(workers, "logger", _InterruptAtStartLog(workers.logger))  # the restart's start
        _assert_no_worker_after(lambda: list(it))  # a worker dies at sample 4 and is restarted


@pytest.mark.timeout(60)
def test_a_ctrl_c_inside_a_workers_start_after_the_fork_leaves_no_worker(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from multiprocessing.context import ForkProcess

    real_start = ForkProcess.start

    def start_then_interrupt(self: Any) -> None:
        monkeypatch.setattr(ForkProcess, "start", real_start)  # once: the first worker's start
        real_start(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(ForkProcess, "start", start_then_interrupt)
    with _loader(tmp_path) as loader:
        _assert_no_worker_after(lambda: iter(loader))


# -- segments (transport/ring.py) ---------------------------------------------------------------
@contextlib.contextmanager
def _interrupt_on_success(shm_dir: str, nbytes: int) -> Iterator[None]:
    """``explain_enospc``, but leaving it without an error raises ``KeyboardInterrupt``: a Ctrl-C
    right after ``Segment.create`` returned."""
    yield
    raise KeyboardInterrupt


def _interrupted_slot(*args: Any, **kw: Any) -> Any:
    raise KeyboardInterrupt  # a Ctrl-C as the new segment's slot is made


@pytest.mark.parametrize("where", ["create", "slot"])
def test_a_ctrl_c_right_after_a_segment_is_created_leaves_no_file(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    ring = ring_mod.Ring(str(tmp_path))
    ring.grow(4096, owner=(0, 0))
    if where == "create":
        monkeypatch.setattr(ring_mod, "explain_enospc", _interrupt_on_success)
    else:
        monkeypatch.setattr(ring_mod, "Slot", _interrupted_slot)
    with pytest.raises(KeyboardInterrupt):
        ring.grow(4096, owner=(0, 1))
    monkeypatch.undo()
    ring.close()
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("step", ["resize", "begin_resize"])
def test_a_ctrl_c_right_after_a_slots_new_segment_is_created_leaves_no_file(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    ring = ring_mod.Ring(str(tmp_path))
    slot = ring.grow(4096, owner=(0, 0))
    monkeypatch.setattr(ring_mod, "explain_enospc", _interrupt_on_success)
    with pytest.raises(KeyboardInterrupt):
        getattr(ring, step)(slot, 1 << 16, (0, 0))
    monkeypatch.undo()
    ring.close()
    assert sorted(os.listdir(tmp_path)) == []


class _FailsOnce:
    """A pin backend's ``on_retire`` whose first call raises ``KeyboardInterrupt`` (a Ctrl-C
    while a segment is unpinned); the later ones do nothing."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, segment: Any) -> None:
        self.calls += 1
        if self.calls == 1:
            raise KeyboardInterrupt


def test_a_ctrl_c_while_a_replaced_segment_is_retired_still_unlinks_it(tmp_path: Any) -> None:
    ring = ring_mod.Ring(str(tmp_path), on_retire=_FailsOnce())
    slot = ring.grow(4096, owner=(0, 0))
    with pytest.raises(KeyboardInterrupt):
        ring.resize(slot, 1 << 16, (0, 0))  # the slot has its new segment; the old one is retired
    assert len(os.listdir(tmp_path)) == 1  # the slot's new segment only
    ring.close()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_ctrl_c_while_close_retires_one_segment_still_unlinks_every_segment(tmp_path: Any) -> None:
    on_retire = _FailsOnce()
    ring = ring_mod.Ring(str(tmp_path), on_retire=on_retire)
    for task in range(3):
        ring.grow(4096, owner=(0, task))
    with pytest.raises(KeyboardInterrupt):
        ring.close()
    assert on_retire.calls == 3  # every segment was unpinned (tried), not only the first
    assert sorted(os.listdir(tmp_path)) == []


class _RemoveThenInterrupt(collections.deque):  # type: ignore[type-arg]
    """The ring's free list, but its next ``remove`` removes and then raises ``KeyboardInterrupt``."""

    def remove(self, value: Any) -> None:
        super().remove(value)
        raise KeyboardInterrupt


def test_a_ctrl_c_while_the_ring_shrinks_still_unlinks_the_slot_it_let_go_of(tmp_path: Any) -> None:
    ring = ring_mod.Ring(str(tmp_path))
    slots = [ring.grow(4096, owner=(0, task)) for task in range(3)]
    for task, slot in enumerate(slots):
        ring.free(slot, (0, task))
    ring._free = _RemoveThenInterrupt(ring._free)
    with pytest.raises(KeyboardInterrupt):
        ring.shrink_to(1)  # the last slot is out of the ring when the Ctrl-C comes
    ring.close()
    assert sorted(os.listdir(tmp_path)) == []
