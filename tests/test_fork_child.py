"""A batch the user hands to a process that other code forks stays intact while that child runs.

The defect: ``multiprocessing`` under fork (Linux's default before Python 3.14) passes a child's
``args`` by inheritance. A batch is a view of a MAP_SHARED slot, so the child's copy of the batch
*is* the slot. The parent dropped its own reference (``Process.start()`` itself deletes
``_args``), the lease fired, a worker wrote a later batch into the slot, and the child's batch
changed under it. torch's DataLoader gives the child an intact batch (num_workers 0 and 2).

Now a slot that was leased while another's fork copied the process is retired when its batch is
dropped (unlinked, unmapped here, its workers told to unmap it) and gets a fresh segment before
its next use: the child keeps the only mapping of the old one. Our own workers' forks (starts and
restarts) do not count (docs/design/slot-lifecycle.md, "Forks by other code").
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import os
import threading
from typing import Any

import fault_datasets as fd
import numpy as np
import pytest
from ring_helpers import OWNER, leased

import shmloader
from shmloader import owner
from shmloader.errors import ShmSpaceError
from shmloader.transport import segment, shm_space
from shmloader.transport.preflight import check_ring_fits
from shmloader.transport.ring import Ring, Slot, SlotState

D, BS, N = 64, 4, 64  # 16 batches an epoch: every slot is written many times over
FIRST = np.arange(BS, dtype=np.float32)  # rows of the first batch: sample i is D copies of i


class Rows:
    """Sample ``i`` is ``D`` copies of ``i``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(D, i, dtype=np.float32)


def _intact(batch: Any) -> bool:
    rows = np.asarray(batch)
    return rows.shape == (BS, D) and bool((rows == FIRST[:, None]).all())


def _check_later(batches: list[Any], ready: Any, send: Any) -> None:
    """In the child: once the parent has gone through its slots again, is each batch as it was?"""
    ready.wait(30)
    send.send([_intact(b) for b in batches])


def _give_first_batches_to_a_child(loaders: list[Any], epochs: int = 3) -> list[bool]:
    """Fork a child holding each loader's first batch, drop them here, run ``epochs`` epochs, and
    return the child's verdict on each batch."""
    ctx = mp.get_context("fork")
    ready, (recv, send) = ctx.Event(), ctx.Pipe(duplex=False)
    its = [iter(loader) for loader in loaders]
    held = [next(it) for it in its]
    child = ctx.Process(target=_check_later, args=(held, ready, send))
    child.start()  # drops its own reference to ``held`` in this process
    try:
        del held
        for it in its:
            for _ in it:  # the rest of the first epoch
                pass
        for _ in range(epochs - 1):
            for loader in loaders:
                for _ in loader:
                    pass
        ready.set()
        assert recv.poll(30), "the child did not answer"
        return list(recv.recv())
    finally:
        child.join(30)
        recv.close()
        send.close()


def _loader(flavour: str, num_workers: int, persistent: bool) -> Any:
    kwargs: dict[str, Any] = dict(batch_size=BS, num_workers=num_workers, persistent_workers=persistent)
    if num_workers:
        kwargs.update(prefetch_factor=1, multiprocessing_context="fork")
    if flavour == "torch":
        pytest.importorskip("torch")
        return importlib.import_module("shmloader.torch").DataLoader(Rows(), **kwargs)
    return shmloader.DataLoader(Rows(), **kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flavour", ["numpy", "torch"])
@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (1, False), (1, True), (2, False), (2, True)])
def test_a_batch_given_to_a_forked_child_stays_intact(flavour: str, num_workers: int, persistent: bool) -> None:
    """With num_workers=0 a batch is ordinary memory, which the fork copies on write: intact anyway."""
    loader = _loader(flavour, num_workers, persistent)
    try:
        assert _give_first_batches_to_a_child([loader]) == [True]
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_batches_of_several_loaders_given_to_one_child_stay_intact() -> None:
    loaders = [_loader("numpy", 1, True), _loader("numpy", 2, False)]
    try:
        assert _give_first_batches_to_a_child(loaders) == [True, True]
    finally:
        for loader in loaders:
            loader.close()


@pytest.mark.timeout(60)
def test_our_own_worker_starts_and_restarts_do_not_retire_held_slots(tmp_path: Any) -> None:
    held_loader = _loader("numpy", 1, True)
    other: shmloader.DataLoader[Any] = shmloader.DataLoader(fd.PlannedFaults(16, str(tmp_path), {3: "kill"}),
                                                            batch_size=2, num_workers=2,
                                                            multiprocessing_context="fork", on_worker_death="restart")
    try:
        it = iter(held_loader)
        batch = next(it)
        ring = held_loader._iterator._ring
        (slot,) = [s for s in ring.slots if s.state is SlotState.LEASED]
        name = slot.segment.name
        mark = owner.fork_mark()
        assert len(list(other)) == 8 and other.stats()["worker_restarts"] == 1
        assert owner.fork_mark() == mark and not owner.forked_since(mark)  # three forks, all ours
        del batch
        for _ in range(2):
            for _ in held_loader:
                pass
        assert slot.segment.name == name and ring.created_total == len(ring.slots)  # none renewed
    finally:
        other.close()
        held_loader.close()


# -- the ring and the fork count, one step at a time ----------------------------------------------
def _fork_and_reap() -> None:
    """Another's fork: a child that exits at once."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0)
    os.waitpid(pid, 0)


def _held_across_a_fork(ring: Ring) -> Slot:
    """A slot of ``ring`` whose batch was held while another's fork ran, then dropped."""
    slot = ring.grow(4096, OWNER)
    # a leased slot is a ctypes array, a buffer numpy's stubs do not list
    view: np.ndarray = np.ndarray((8,), np.uint8, buffer=leased(ring, slot))  # type: ignore[arg-type]
    _fork_and_reap()
    del view
    gc.collect()
    return slot


def test_a_slot_leased_across_a_foreign_fork_gets_a_fresh_segment() -> None:
    retired: list[str] = []
    created: list[str] = []
    ring = Ring("/dev/shm", max_slots=1, on_create=lambda s: created.append(s.name),
                on_retire=lambda s: retired.append(s.name))
    try:
        slot = ring.grow(4096, OWNER)
        old = slot.segment.name
        # a leased slot is a ctypes array, a buffer numpy's stubs do not list
        view: np.ndarray = np.ndarray((8,), np.uint8, buffer=leased(ring, slot))  # type: ignore[arg-type]
        _fork_and_reap()
        del view
        gc.collect()
        assert ring.collect_released() == 1 and slot.state is SlotState.FREE and slot.spent
        assert not os.path.exists(f"/dev/shm/{old}") and old in ring.retired_names and retired == [old]
        assert ring.take(4096, OWNER) is slot  # max_slots=1: the same slot, with a new segment
        assert slot.segment.name != old and not slot.spent and created == [old, slot.segment.name]
        assert len(ring.slots) == 1 and ring.created_total == 2 and ring.count(SlotState.ASSIGNED) == 1
        ring.free(slot, OWNER)
        view = np.ndarray((8,), np.uint8, buffer=leased(ring, ring.take(4096, OWNER)))
        del view
        gc.collect()  # no fork this time: the slot keeps its segment
        assert ring.collect_released() == 1 and not slot.spent and ring.created_total == 2
    finally:
        ring.close()


def test_a_spent_slot_is_unlinked_once_by_close_and_shrink(monkeypatch: pytest.MonkeyPatch) -> None:
    retired: list[str] = []
    ring = Ring("/dev/shm", on_retire=lambda s: retired.append(s.name))
    slots: list[Any] = []
    views: list[np.ndarray] = []
    for k in range(3):
        slots.append(ring.grow(4096, (0, k)))
        ring.fill(slots[-1], (0, k))
        # a leased slot is a ctypes array, a buffer numpy's stubs do not list
        views.append(np.ndarray((8,), np.uint8, buffer=ring.lease(slots[-1], (0, k))))  # type: ignore[arg-type]
    _fork_and_reap()
    del views
    gc.collect()
    assert ring.collect_released() == 3 and all(s.spent for s in slots) and len(retired) == 3
    monkeypatch.setattr(shm_space, "shm_free_bytes", lambda d: 2 * 4096)
    with pytest.raises(ShmSpaceError):  # the pre-flight counts a spent slot as needing a fresh segment
        check_ring_fits(ring, 4096, 3, num_workers=1, prefetch_factor=1)
    check_ring_fits(ring, 4096, 2, num_workers=1, prefetch_factor=1)
    ring.shrink_to(2)  # the last slot goes, its segment already retired
    assert len(ring.slots) == 2 and len(retired) == 3
    ring.close()
    assert len(retired) == 3 and not any(os.path.exists(f"/dev/shm/{n}") for n in retired)


def test_a_spent_slot_that_cannot_be_renewed_stays_free(monkeypatch: pytest.MonkeyPatch) -> None:
    ring = Ring("/dev/shm")
    try:
        slot = _held_across_a_fork(ring)

        def full(*_args: Any, **_kwargs: Any) -> Any:
            raise ShmSpaceError("full", needed_bytes=4096, free_bytes=0, directory="/dev/shm")

        with monkeypatch.context() as m:
            m.setattr(ring, "_new_segment", full)
            with pytest.raises(ShmSpaceError):
                ring.take(4096, OWNER)
        assert slot.state is SlotState.FREE and slot.owner is None and slot.spent
        assert ring.take(4096, OWNER) is slot and not slot.spent  # room again: renewed
    finally:
        ring.close()


class _Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_a_fenced_slot_cools_before_its_segment_is_retired() -> None:
    """A pinned ring: the device copy enqueued before the drop may read the slot until its fence."""
    retired: list[str] = []
    events: list[_Event] = []

    def fence() -> _Event:
        events.append(_Event())
        return events[-1]

    ring = Ring("/dev/shm", on_retire=lambda s: retired.append(s.name), fence=fence)
    try:
        slot = _held_across_a_fork(ring)
        assert ring.collect_released() == 0 and ring.cooling == 1 and retired == []
        events[0].done = True
        assert ring.collect_released() == 1 and slot.spent and retired == [slot.segment.name]
    finally:
        ring.close()


def test_the_fork_count_ignores_our_forks_and_errs_towards_a_fork() -> None:
    mark = owner.fork_mark()
    with owner.our_fork():
        _fork_and_reap()
    assert owner.fork_mark() == mark and not owner.forked_since(mark)
    go, done = threading.Event(), threading.Event()

    def marked_thread() -> None:  # another thread forks one of ours meanwhile: this fork is still another's
        with owner.our_fork():
            go.set()
            done.wait(10)

    t = threading.Thread(target=marked_thread)
    t.start()
    go.wait(10)
    _fork_and_reap()
    done.set()
    t.join()
    assert owner.forked_since(mark) and owner.fork_mark() != mark
    owner._before_fork()  # a fork under way (its child may copy what is made now)
    try:
        during = owner.fork_mark()
        assert during == -1 and owner.forked_since(owner.fork_mark())
    finally:
        owner._after_in_parent()
    assert owner.forked_since(during) and not owner.forked_since(owner.fork_mark())


def test_a_ctrl_c_right_after_our_fork_marks_the_thread_leaves_its_later_forks_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``our_fork`` marks the thread with ``set.add``; a Ctrl-C raised as that call returns used to
    leave the mark for good, and the thread's later forks by other code went uncounted (a batch
    held across one could then be overwritten)."""

    class MarkThenInterrupt(set):
        def add(self, ident: int) -> None:
            super().add(ident)
            raise KeyboardInterrupt

    monkeypatch.setattr(owner, "_our_forks", MarkThenInterrupt())
    with pytest.raises(KeyboardInterrupt):
        with owner.our_fork():
            pass  # pragma: no cover - not reached
    mark = owner.fork_mark()
    _fork_and_reap()
    assert owner.forked_since(mark)
