"""An iterator or loader the caller drops lets go of its workers, pipes and segments at once.

The suite's guards (conftest.py) run ``gc.collect()`` before they look, so a reference cycle
through an iterator hides from them: its workers, descriptors and segments live until the cyclic
collector happens to visit it, which in a process with a large heap (a training script) is rare,
so each dropped iterator adds to the pile. These tests switch the collector off while they drop
what they made: what is not freed by reference counting alone is a leak here.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from process_helpers import workers_left

from shmloader import DataLoader, Dataset
from shmloader.errors import LoaderError


class Boom(ValueError):
    """The dataset's own error."""


class FailsAt(Dataset):
    """Rows ``i``; raises :class:`Boom` for the one index ``bad``."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if i == self.bad:
            raise Boom(i)
        return np.full(4, i, dtype=np.int64)


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Only reference counting frees objects inside; the collector runs (and is restored) after."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        gc.collect()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterator_dropped_after_a_dataset_error_is_freed_at_once(num_workers: int) -> None:
    """The batch's error used to stay on the iterator (``_user_error``) after it was raised; its
    traceback's frames refer to the iterator: a cycle that kept the workers running and the
    ring mapped after ``except Boom: break`` dropped the iterator."""
    loader: DataLoader[Any] = DataLoader(FailsAt(16, bad=5), batch_size=4, num_workers=num_workers)
    with no_cyclic_gc():
        fds = []
        for _ in range(5):
            it = iter(loader)
            try:
                for _batch in it:
                    pass
            except Boom:
                pass  # the caller gives up on the epoch
            gone = weakref.ref(it)
            del it
            assert gone() is None, "the iterator outlived its last reference (a reference cycle)"
            fds.append(_fds())  # the first cycle may start shared helpers (the resource tracker)
        assert workers_left() == []
        assert fds[-1] <= fds[0], fds


class Rows(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(4, i, dtype=np.int64)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("torch_flavour", [False, True])
def test_a_persistent_loader_dropped_without_close_stops_its_workers_at_once(torch_flavour: bool) -> None:
    """Every loader was in a reference cycle (``loader._book._loader``), and with
    ``persistent_workers`` its iterator in one with it (``loader._iterator._plan`` held
    ``loader._make_ring``, ``_worker_spec``, ``_finish_batch`` and the book). Dropping such a
    loader without ``close()`` left its workers, pipes and segments to the cyclic collector:
    with a training script's heap, 40 loaders dropped in a loop left 22 workers, 198 descriptors
    and 66 segments running. torch's DataLoader has no such cycle (``del loader`` stops them)."""
    loader = _loader_class(torch_flavour)(Rows(), batch_size=4, num_workers=2, persistent_workers=True)
    gone = weakref.ref(loader)
    try:
        with no_cyclic_gc():
            for _batch in loader:
                pass
            del loader, _batch
            assert gone() is None
            assert workers_left() == []
    finally:
        left = gone()
        if left is not None:  # the leak: stop what it holds, so that the next test starts clean
            left.close()


def _loader_class(torch_flavour: bool) -> type:
    if not torch_flavour:
        return DataLoader
    pytest.importorskip("torch")
    import shmloader.torch

    return shmloader.torch.DataLoader


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_dropped_is_freed_at_once(num_workers: int) -> None:
    loader: DataLoader[Any] = DataLoader(Rows(), batch_size=4, num_workers=num_workers)
    gone = weakref.ref(loader)
    with no_cyclic_gc():
        assert len(list(loader)) == 4
        del loader
        assert gone() is None, "the loader outlived its last reference (a reference cycle)"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_an_iterator_goes_on_after_its_loader_is_dropped_as_torch_s_does(persistent: bool) -> None:
    """``for batch in DataLoader(...)``: the loader is a temporary, the iterator is the loop's. A
    loader dropped (or collected) must not stop an iterator someone still uses; the iterator's
    workers stop when it is dropped in turn."""
    it = iter(DataLoader(Rows(), batch_size=4, num_workers=2, persistent_workers=persistent))
    gc.collect()  # whatever the loader's fate, it comes now
    assert [int(b[0, 0]) for b in it] == [0, 4, 8, 12]
    with no_cyclic_gc():
        del it
        assert workers_left() == []


@pytest.mark.timeout(60)
def test_an_iterator_s_state_needs_its_loader_and_says_so_when_gone() -> None:
    """Without persistent workers the iterator keeps its loader (its state is the loader's); a
    persistent iterator, which its loader holds, cannot, and says what is missing."""
    it = iter(DataLoader(Rows(), batch_size=4, num_workers=2))
    next(it)
    gc.collect()
    assert it.state_dict()["epoch"] is not None
    del it
    it = iter(DataLoader(Rows(), batch_size=4, num_workers=2, persistent_workers=True))
    next(it)
    gc.collect()
    with pytest.raises(LoaderError, match="DataLoader this iterator came from is gone"):
        it.state_dict()
    it.close()


class Grows(Dataset):
    """Rows of 4 floats, then (from index 8) of 512 Ki floats: the slot must grow."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(1 << 19 if i >= 8 else 4, float(i))


@pytest.mark.timeout(60)
def test_an_iterator_whose_growth_was_refused_is_freed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused growth is kept and raised at the next wait; raised from a local of that wait, the
    error's traceback held the frame holding the error: a cycle that kept the iterator, and a
    segment a batch had viewed, mapped (``stress/shm_pressure.py`` could not unmount its tmpfs)."""
    from shmloader.errors import ShmSpaceError
    from shmloader.transport import shm_space

    monkeypatch.setattr(shm_space, "shm_free_bytes", lambda d: 12 << 20)  # 1 MiB slots fit, 4 MiB ones not
    loader: DataLoader[Any] = DataLoader(Grows(), batch_size=2, num_workers=1)
    with no_cyclic_gc():
        it = iter(loader)
        with pytest.raises(ShmSpaceError):
            for _batch in it:
                pass
        gone = weakref.ref(it)
        del it, _batch
        assert gone() is None, "the iterator outlived its last reference (a reference cycle)"


class FailingSampler:
    """Batches [0, 1], [2, 3], ... then a sampler error at batch ``bad``."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 8

    def __iter__(self) -> Iterator[list[int]]:
        for k in range(8):
            if k == self.bad:
                raise Boom("the sampler's own error")
            yield [2 * k, 2 * k + 1]


@pytest.mark.timeout(60)
def test_an_iterator_whose_sampler_failed_during_a_refill_is_freed_at_once() -> None:
    loader: DataLoader[Any] = DataLoader(Rows(), batch_sampler=FailingSampler(bad=5), num_workers=2)
    with no_cyclic_gc():
        it = iter(loader)
        got = []
        with pytest.raises(Boom):
            for batch in it:
                got.append(int(batch[0, 0]))
        assert got and got == list(range(0, 2 * len(got), 2))
        gone = weakref.ref(it)
        del it, batch
        assert gone() is None, "the iterator outlived its last reference (a reference cycle)"
        assert workers_left() == []


class FailsOnTask1:
    """An observer whose report of batch 1 raises (a PluginError at the next ``next()``)."""

    def shmloader_batch_ready(self, task: int) -> None:
        if task == 1:
            raise ValueError("observer bug")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterator_whose_observer_failed_is_freed_at_once(num_workers: int) -> None:
    from shmloader.errors import PluginError

    loader: DataLoader[Any] = DataLoader(Rows(), batch_size=4, num_workers=num_workers, plugins=[FailsOnTask1()])
    with no_cyclic_gc():
        it = iter(loader)
        next(it), next(it)
        with pytest.raises(PluginError):
            next(it)
        gone = weakref.ref(it)
        del it
        assert gone() is None, "the iterator outlived its last reference (a reference cycle)"
