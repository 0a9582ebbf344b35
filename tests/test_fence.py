"""Release fences: a dropped pinned batch's slot is reused only after the device copies are done.

torch's pattern ``x = x.to("cuda", non_blocking=True)`` drops the pinned source at once, while the
copy may still be queued on the GPU. torch's caching host allocator keeps its pinned buffer until
an event on the copy's stream completes; shmloader's slots get the same from a fence: an event the
pin backend records on the current stream when the batch's last view dies. What must hold: a slot
whose fence has not completed is never handed to a worker (the ring grows instead); it is free as
soon as the fence completes; at ``max_slots`` the ring waits for the oldest fence rather than
failing; a fence that cannot be recorded is logged, never raised from the finalizer; unpinned and
mlock'd rings have no fence at all.

And no fence, nor any other call into a backend, ever comes from a process other than the one that
created the backend (issue 13): a forked worker that garbage-collects the parent's batches, leases
or a device prefetcher makes no backend call, and a backend, its events and the prefetcher are
inert there whoever calls them.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

from iter_helpers import mp_iter
import numpy as np
import pytest
from ring_helpers import OWNER, leased

import shmloader
from shmloader.gpu.backends import TorchCudaBackend, _TorchEvent, _TorchFence
from shmloader.gpu.cupy_backend import CupyBackend, _CupyEvent
from shmloader.gpu.fake import FakeBackend, FakeEvent, read_journal
from shmloader.gpu.mlock import MlockBackend
from shmloader.gpu.owned import ForeignProcessError
from shmloader.gpu.prefetch_epoch import Epoch
from shmloader.owner import ProcessOwner
from shmloader.transport.ring import Ring, SlotState
from shmloader.transport.segment import Segment

PAGE = 4096


def ring_with(fence: Any, tmp_path: Any, max_slots: int = 0) -> Ring:
    return Ring(str(tmp_path), max_slots=max_slots, fence=fence)


def lease_and_drop(ring: Ring, slot: Any) -> None:
    ring.fill(slot, OWNER)
    buf = leased(ring, slot)
    del buf
    gc.collect()


class Fences:
    """A fence factory whose events complete only when the test says so."""

    def __init__(self) -> None:
        self.events: list[FakeEvent] = []

    def __call__(self) -> FakeEvent:
        self.events.append(FakeEvent(len(self.events)))
        return self.events[-1]


def test_a_slot_cools_until_its_fence_completes(tmp_path: Any) -> None:
    fences = Fences()
    ring = ring_with(fences, tmp_path)
    try:
        slot = ring.grow(PAGE, OWNER)
        lease_and_drop(ring, slot)
        assert len(fences.events) == 1  # recorded when the last view died
        assert ring.take(PAGE, OWNER) is None and ring.cooling == 1
        assert slot.state is SlotState.LEASED
        fences.events[0].complete()
        again = ring.take(PAGE, OWNER)
        assert again is slot and ring.cooling == 0
    finally:
        ring.close()


def test_at_max_slots_the_ring_waits_for_the_oldest_fence(tmp_path: Any) -> None:
    fences = Fences()
    ring = ring_with(fences, tmp_path, max_slots=2)
    try:
        first, second = ring.grow(PAGE, OWNER), ring.grow(PAGE, OWNER)
        lease_and_drop(ring, first)
        lease_and_drop(ring, second)
        assert ring.take(PAGE, OWNER) is None
        slot = ring.grow(PAGE, OWNER)  # no RingExhausted: the oldest fence is waited for
        assert slot is first
        assert fences.events[0].synchronized and not fences.events[1].synchronized
        assert len(ring.slots) == 2
    finally:
        ring.close()


def test_a_failing_fence_is_logged_and_the_slot_reused(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise RuntimeError("no stream here")

    ring = ring_with(broken, tmp_path)
    try:
        slot = ring.grow(PAGE, OWNER)
        with caplog.at_level(logging.WARNING, logger="shmloader"):
            lease_and_drop(ring, slot)
        assert any("could not fence slot 0" in r.getMessage() and "no stream here" in r.getMessage()
                   for r in caplog.records)
        assert ring.take(PAGE, OWNER) is slot
    finally:
        ring.close()


def test_without_a_fence_a_dropped_slot_is_free_at_once(tmp_path: Any) -> None:
    ring = ring_with(None, tmp_path)
    try:
        slot = ring.grow(PAGE, OWNER)
        lease_and_drop(ring, slot)
        assert ring.take(PAGE, OWNER) is slot
    finally:
        ring.close()


def test_a_stale_release_after_close_is_ignored(tmp_path: Any) -> None:
    fences = Fences()
    ring = ring_with(fences, tmp_path)
    slot = ring.grow(PAGE, OWNER)
    ring.fill(slot, OWNER)
    buf = leased(ring, slot)
    ring.close()
    del buf
    gc.collect()
    assert ring.collect_released() == 0 and ring.cooling == 0


# -- through a loader ----------------------------------------------------------------------------
ROWS, COLS = 64, 8


def loader(**kwargs: Any) -> shmloader.DataLoader:
    data = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    return shmloader.DataLoader(shmloader.ArrayDataset(data), batch_size=8, num_workers=1, pin_memory=True,
                                persistent_workers=True, prefetch_factor=1, **kwargs)


@pytest.mark.timeout(60)
def test_no_worker_rewrites_a_slot_before_its_fence_completes(fake: FakeBackend) -> None:
    fake.fences_done = False
    dl = loader()
    try:
        for k, (x,) in enumerate(dl):
            expect = np.arange(k * 8 * COLS, (k + 1) * 8 * COLS, dtype=np.float32).reshape(8, COLS)
            np.testing.assert_array_equal(x, expect)
            del x
        ring = mp_iter(dl._iterator)._ring
        gc.collect()
        ring.collect_released()
        # Every batch of the epoch was dropped but no fence completed: no slot was ever reused.
        assert len(fake.fences) == ROWS // 8
        assert ring.created_total == len(ring.slots) == ROWS // 8
        for event in fake.fences:
            event.complete()
        ring.collect_released()
        assert ring.count(SlotState.FREE) == len(ring.slots) and ring.cooling == 0
        # The next epoch (fences completing at once) reuses those slots: no new segment, no new
        # registration.
        fake.fences_done = True
        assert sum(1 for _ in dl) == ROWS // 8
        assert ring.created_total == ROWS // 8 and fake.count("register") == ROWS // 8
    finally:
        dl.close()


@pytest.mark.timeout(60)
def test_with_max_slots_a_loader_waits_for_fences_instead_of_failing(fake: FakeBackend) -> None:
    fake.fences_done = False
    dl = loader(max_slots=2)
    try:
        got = [x.copy() for (x,) in dl]
        assert len(got) == ROWS // 8
        np.testing.assert_array_equal(np.concatenate(got), np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS))
        assert len(mp_iter(dl._iterator)._ring.slots) <= 2
        assert any(e.synchronized for e in fake.fences)
    finally:
        dl.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["none", "mlock"])
def test_no_fence_without_a_device_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMLOADER_PIN_BACKEND", backend)
    with pytest.warns(UserWarning):  # torch's "no accelerator" warning (mlock pins for no device)
        dl = loader()
        try:
            assert sum(1 for _ in dl) == ROWS // 8
            assert mp_iter(dl._iterator)._ring._fence is None
        finally:
            dl.close()


# -- ownership: nothing of the parent's acts in a forked child (issue 13) -----------------------


def in_forked_child(body: Callable[[], Any]) -> Any:
    """Run ``body`` in a child made by ``os.fork`` and return what it returned (pickled back).

    The child never returns into pytest: it leaves with ``os._exit``. An exception in ``body`` is
    re-raised here with the child's message.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_fd)
        code = 0
        try:
            try:
                payload = pickle.dumps(("ok", body()))
            except BaseException as exc:  # report everything, then leave without unwinding
                payload, code = pickle.dumps(("error", f"{type(exc).__name__}: {exc}")), 1
            with os.fdopen(write_fd, "wb") as out:
                out.write(payload)
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as result:
        data = result.read()
    os.waitpid(pid, 0)
    status, value = pickle.loads(data)
    if status != "ok":
        raise AssertionError(f"the forked child failed: {value}")
    return value


class Recorder:
    """Stands in for ``torch`` / ``cupy``: records every attribute reached, answers with itself."""

    def __init__(self, log: list[str] | None = None, path: str = "") -> None:
        self._log, self._path = (log if log is not None else []), path

    def __getattr__(self, name: str) -> Recorder:
        path = f"{self._path}.{name}".lstrip(".")
        self._log.append(path)
        return Recorder(self._log, path)

    def __call__(self, *args: Any, **kwargs: Any) -> Recorder:
        self._log.append(f"{self._path}()")
        return self


def _refused(call: Callable[[], Any]) -> bool:
    try:
        call()
    except ForeignProcessError:
        return True
    return False


@pytest.mark.timeout(60)
def test_every_backend_entry_point_is_inert_in_a_forked_child(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = str(tmp_path / "calls")
    fake = FakeBackend(journal=journal, fences_done=False)
    segment = Segment.create(str(tmp_path), PAGE)
    fake.register_segment(segment)
    torch_runtime, cupy_runtime = Recorder(), Recorder()
    if importlib.util.find_spec("torch") is None:  # the backend imports torch when it is made
        monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace())
    torch_backend = TorchCudaBackend()
    # a Recorder in torch's place: every torch call the backend makes lands in the log
    torch_backend._torch = torch_runtime  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cupy_runtime.cuda))
    cupy_backend = CupyBackend()
    libc_calls: list[str] = []

    def libc_call(name: str) -> Callable[..., int]:
        def call(*args: Any) -> int:
            libc_calls.append(name)
            return 0
        return call

    libc = types.SimpleNamespace(mlock=libc_call("mlock"), munlock=libc_call("munlock"))
    mlock_backend = MlockBackend(libc=libc)
    owner = ProcessOwner()
    events: list[Any] = [FakeEvent(1), _TorchEvent(Recorder(torch_runtime._log), owner),
                         _CupyEvent(Recorder(cupy_runtime._log), owner),
                         _TorchFence([Recorder(torch_runtime._log)] * 2, owner)]
    torch_runtime._log.clear()
    cupy_runtime._log.clear()

    def child() -> dict[str, Any]:
        found: dict[str, Any] = {}
        backends: tuple[Any, ...] = (fake, torch_backend, cupy_backend, mlock_backend)  # mlock: no Transfer side
        for backend in backends:
            name = backend.name
            found[f"{name} fence"] = backend.fence()
            found[f"{name} register"] = backend.register_segment(segment)
            found[f"{name} unregister"] = backend.unregister_segment(segment)
            if name != "mlock":  # the Transfer side
                found[f"{name} wait"] = backend.wait((), events[0], "cuda")
                found[f"{name} new_stream refused"] = _refused(lambda: backend.new_stream("cuda"))
                found[f"{name} copy refused"] = _refused(lambda: backend.copy((), "cuda", None, True))
        found["queries"] = [event.query() for event in events]  # True: nothing to wait for here
        found["synchronize"] = [event.synchronize() for event in events]
        found["fake state"] = (fake.registered == {segment.name: fake.registered.get(segment.name)},
                               fake.fences, events[0].synchronized)
        found["runtime calls"] = torch_runtime._log + cupy_runtime._log + libc_calls
        return found

    try:
        found = in_forked_child(child)
    finally:
        fake.unregister_segment(segment)
        segment.unlink()
        segment.close()
    assert found.pop("runtime calls") == []  # not one accelerator (or libc) call in the child
    assert found.pop("queries") == [True, True, True, True]
    assert found.pop("fake state") == (True, [], False)
    refused = {k: v for k, v in found.items() if k.endswith("refused")}
    assert refused and all(refused.values())
    assert all(v is None for k, v in found.items() if not k.endswith("refused") and k != "synchronize")
    by_pid: dict[int, list[str]] = {}
    for call in read_journal(journal):
        by_pid.setdefault(call.pid, []).append(call.kind + (" (inert)" if call.inert else ""))
    child_calls = [calls for pid, calls in by_pid.items() if pid != os.getpid()]
    assert by_pid[os.getpid()] == ["register", "unregister"]
    assert child_calls == [["fence (inert)", "register (inert)", "unregister (inert)", "wait (inert)",
                            "stream (inert)", "copy (inert)"]]


@pytest.mark.timeout(60)
def test_a_prefetcher_inherited_mid_epoch_is_inert_in_a_forked_child(fake: FakeBackend, tmp_path: Any) -> None:
    fake.journal = str(tmp_path / "calls")
    dl = loader()
    try:
        moved = shmloader.to_device(dl, "cpu", max_held=8)
        steps = iter(moved)
        assert isinstance(steps, Epoch)  # the prefetcher's epoch, which a worker may inherit
        next(steps)  # batch 0 held (its copy unfinished), batch 1 read ahead and copying

        def child() -> tuple[int, bool]:
            steps.close()  # what a worker's garbage collector does to the inherited generator
            gc.collect()
            return len(moved.held), any(e.synchronized for e in fake.events)

        held, synchronized = in_forked_child(child)
        assert held == 1 and not synchronized  # nothing drained, nothing waited for, in the child
        assert {c.pid for c in read_journal(fake.journal)} == {os.getpid()}
        for event in fake.events:
            event.complete()
        assert sum(1 for _ in steps) == ROWS // 8 - 1  # the parent's epoch goes on unharmed
    finally:
        dl.close()


def collect_garbage(worker_id: int) -> None:
    """worker_init_fn: collect the garbage the worker inherited from the parent (issue 13)."""
    gc.collect()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("garbage", ["batches", "prefetcher"])
def test_no_backend_call_comes_from_a_worker_collecting_inherited_garbage(
        fake: FakeBackend, tmp_path: Any, garbage: str) -> None:
    """Issue 13's repro on a CPU: a pinned loader's batches (or a prefetcher stopped mid-epoch)
    left in a reference cycle; a second loader forks workers that collect it at start."""
    fake.journal = str(tmp_path / "calls")
    data = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
    first: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(data), batch_size=16, num_workers=2,
                                                            pin_memory=True, multiprocessing_context="fork")
    if garbage == "batches":
        held: Any = list(first)
    else:  # batches held by the prefetcher, its copies unfinished
        held = iter(shmloader.to_device(first, "cpu", max_held=64))
        next(held)
    cycle: list[Any] = [held]
    cycle.append(cycle)
    gc.disable()  # the garbage must still be there when the second loader forks its workers
    try:
        del held, cycle, first
        second: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(data), batch_size=16,
                                                                 num_workers=2, worker_init_fn=collect_garbage,
                                                                 multiprocessing_context="fork")
        assert sum(len(x) for (x,) in second) == 256
        second.close()
    finally:
        gc.enable()
    for event in fake.events:
        event.complete()
    gc.collect()  # the main process collects the same garbage: its calls come from here
    calls = read_journal(fake.journal)
    assert any(c.kind in ("fence", "unregister") for c in calls)  # the garbage reached the backend
    from_workers = [c for c in calls if c.pid != os.getpid()]
    assert from_workers == [], f"{len(from_workers)} of {len(calls)} backend calls came from worker pids"
