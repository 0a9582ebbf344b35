"""The release side of the Ctrl-C windows (tests/test_interrupt_windows.py has the taking side):
a ``KeyboardInterrupt`` raised as an owner lets go of what it holds still lets go of all of it.

CPython raises a pending SIGINT right after a call into C returns, or as a Python function
starts. So a ``finally`` that first asks whether it holds a lock, then releases it, can be cut
between the two: the step lock stayed held for good, ``close()`` then took itself for a hook
inside ``next()`` and stopped nothing, and the workers and segments outlived the loader. The same
kind of window let a fresh segment outlive ``Segment.create`` and a pinned one skip the pin
backend's ``on_retire``, and an error while the ring closed left the iterator's wake-up pipe open.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from process_helpers import workers_left

from shmloader import DataLoader
from shmloader.errors import LoaderClosed
from shmloader.transport import ring as ring_mod
from shmloader.transport.segment import Segment


class _InterruptOnTheWayOut:
    """The step lock; once ``armed``, its next call does the real work and then raises
    ``KeyboardInterrupt``, as a Ctrl-C right after that C call returned would."""

    def __init__(self, real: Any) -> None:
        self.real, self.armed = real, False

    def _interrupted(self, name: str, *args: Any) -> Any:
        out = getattr(self.real, name)(*args)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return out

    def _is_owned(self) -> bool:
        return self._interrupted("_is_owned")

    def release(self) -> None:
        self._interrupted("release")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _loader(tmp_path: Any) -> DataLoader:
    return DataLoader(np.arange(32), batch_size=2, num_workers=2, shm_dir=str(tmp_path),
                      multiprocessing_context="fork", persistent_workers=True)


@pytest.mark.timeout(60)
def test_a_ctrl_c_as_next_gives_the_step_lock_back_leaves_it_free(tmp_path):
    loader = _loader(tmp_path)
    it = iter(loader)
    lock = it._guard._lock = _InterruptOnTheWayOut(it._guard._lock)
    step = it._step

    def step_then_arm() -> Any:
        batch = step()
        lock.armed = True  # the next call on the lock is the step's way out
        return batch

    it._step = step_then_arm
    try:
        with pytest.raises(KeyboardInterrupt):
            next(it)
        assert not lock.real._is_owned()
        loader.close()  # took itself for a hook inside next() and stopped nothing while the lock was held
        assert workers_left() == [] and os.listdir(tmp_path) == []
    finally:
        it._guard._lock = lock.real
        loader.close()


@pytest.mark.timeout(60)
def test_a_ctrl_c_as_close_gives_the_step_lock_back_leaves_it_free(tmp_path):
    loader = _loader(tmp_path)
    it = iter(loader)
    next(it)
    lock = it._guard._lock = _InterruptOnTheWayOut(it._guard._lock)
    close_owned = it._close_owned

    def shut_then_arm() -> None:
        close_owned()
        lock.armed = True

    it._close_owned = shut_then_arm
    try:
        with pytest.raises(KeyboardInterrupt):
            it.close()
        assert not lock.real._is_owned()
        assert workers_left() == [] and os.listdir(tmp_path) == []
        with pytest.raises(LoaderClosed):  # refused as a re-entry while the lock was held
            next(it)
    finally:
        it._guard._lock = lock.real
        loader.close()


def test_a_ctrl_c_as_create_closes_its_own_descriptor_leaves_no_file(tmp_path, monkeypatch):
    real = Segment._release
    fired: list[bool] = []

    def release_then_interrupt(self: Segment) -> None:
        real(self)
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt

    before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(Segment, "_release", release_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        Segment.create(str(tmp_path), 4096)
    monkeypatch.undo()
    assert fired and os.listdir(tmp_path) == [] and len(os.listdir("/proc/self/fd")) == before


class _Pins:
    """A pin backend's hooks: what it registered and not yet let go of."""

    def __init__(self) -> None:
        self.registered: set[str] = set()

    def on_create(self, segment: Segment) -> None:
        self.registered.add(segment.name)

    def on_retire(self, segment: Segment) -> None:
        assert not segment.buf.closed, "unpinned after the memory was unmapped"
        self.registered.discard(segment.name)


def test_a_ctrl_c_as_a_new_slot_is_made_lets_the_pin_backend_unpin_its_segment(tmp_path, monkeypatch):
    pins = _Pins()
    ring = ring_mod.Ring(str(tmp_path), on_create=pins.on_create, on_retire=pins.on_retire)
    ring.grow(4096, owner=(0, 0))

    def interrupted_slot(*args: Any, **kw: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(ring_mod, "Slot", interrupted_slot)
    with pytest.raises(KeyboardInterrupt):
        ring.grow(4096, owner=(0, 1))
    monkeypatch.undo()
    ring.close()
    assert os.listdir(tmp_path) == [] and pins.registered == set()


@pytest.mark.timeout(60)
def test_an_error_as_the_ring_closes_still_closes_the_wake_up_pipe(tmp_path):
    loader = _loader(tmp_path)
    it = iter(loader)
    next(it)
    ring = it._ring
    real_close = ring.close

    def close_then_fail() -> None:
        real_close()
        raise RuntimeError("a pin backend's unpin failed")

    ring.close = close_then_fail
    try:
        with pytest.raises(RuntimeError, match="unpin failed"):
            it.close()
        assert it._guard.wake_fd == -1 and workers_left() == [] and os.listdir(tmp_path) == []
    finally:
        loader.close()
