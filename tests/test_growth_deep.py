"""Slots that grow under a deep pipeline: every task a worker holds can answer ``TooSmall`` before
the first retry reaches it, so the worker keeps every batch it was told is too small until its
retry comes (worker/main.py, ``_Worker.pending``); a retry never fetches again. An iterable
dataset is not advanced twice (no batch lost), and a map-style dataset's random augmentation draws
once per sample, as torch's does."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

import shmloader

N = 30


class Stream(shmloader.IterableDataset):
    """Batches of more than the first 1 MiB slot, growing when ``growing``."""

    def __init__(self, growing: bool) -> None:
        self.growing = growing

    def __iter__(self):  # noqa: ANN204
        for i in range(N):
            n = min(int(150_000 * 1.3 ** i), 4_000_000) if self.growing else 300_000
            yield np.full(n, i, dtype=np.float64)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("growing", [False, True])
@pytest.mark.parametrize("prefetch", [2, 9, 12])
def test_an_iterable_dataset_loses_no_batch_when_a_deep_pipeline_grows_its_slots(prefetch, growing):
    loader = shmloader.DataLoader(Stream(growing), batch_size=None, num_workers=1, prefetch_factor=prefetch)
    try:
        got = []
        for b in loader:
            assert (b == b[0]).all()
            got.append(int(b[0]))
    finally:
        loader.close()
    assert got == list(range(N))


class Augmented:
    """Map-style; each sample (2.4 MB: more than the first slot) draws its first value from numpy's
    global RNG, which workers seed as torch's do."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> np.ndarray:
        x = np.full(300_000, i, dtype=np.float64)
        x[0] = np.random.rand()
        return x


def _draws(make, prefetch):  # noqa: ANN001, ANN202
    import torch

    loader = make(Augmented(), batch_size=None, num_workers=1, prefetch_factor=prefetch,
                  generator=torch.Generator().manual_seed(0))
    try:
        return [(int(b[1]), float(b[0])) for b in loader]
    finally:
        getattr(loader, "close", lambda: None)()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("prefetch", [2, 9])
def test_a_grown_slot_keeps_torchs_random_augmentation_under_a_deep_pipeline(prefetch):
    torch = pytest.importorskip("torch")
    import shmloader.torch as sdl

    assert _draws(sdl.DataLoader, prefetch) == _draws(torch.utils.data.DataLoader, prefetch)


class Tracker:
    """Sets ``freed[serial]`` when the worker that made it lets it go (not when a copy made by
    unpickling a batch dies in the main process)."""

    def __init__(self, freed, serial: int) -> None:  # noqa: ANN001 - an mp.Array
        self.freed, self.serial, self.pid = freed, serial, os.getpid()

    def __getstate__(self) -> dict:
        return {"serial": self.serial, "pid": self.pid}

    def __del__(self) -> None:
        if self.pid == os.getpid():
            self.freed[self.serial] = 1


class Tracked:
    """Map-style; each sample (2.4 MB: more than the first slot) carries a ``Tracker`` numbered by
    the order in which its worker fetched it."""

    fetched = 0

    def __init__(self, freed) -> None:  # noqa: ANN001 - an mp.Array
        self.freed = freed

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple:
        serial = Tracked.fetched
        Tracked.fetched += 1
        return np.full(300_000, i, dtype=np.float64), Tracker(self.freed, serial)


@pytest.mark.timeout(120)
def test_a_batch_kept_for_an_abandoned_epochs_retry_is_let_go_by_the_next_epoch():
    """A persistent worker keeps each too-small batch until its retry; when the epoch is abandoned
    first, no retry comes, and the next epoch's first task lets the kept batches go."""
    freed = mp.get_context("fork").Array("b", 64, lock=False)
    loader = shmloader.DataLoader(Tracked(freed), batch_size=None, num_workers=1, persistent_workers=True,
                                  prefetch_factor=4, multiprocessing_context="fork")
    try:
        it = iter(loader)
        it._dispatch()  # tasks 0-3 at the first 1 MiB slot: each is fetched, answers TooSmall and is kept
        it = iter(loader)  # the epoch abandoned before any retry
        assert [int(b[0][0]) for b in it] == list(range(12))
        # the worker's first four fetches, the abandoned epoch's, were let go before the batch of
        # the next epoch's first task came back (and not only when the worker exits)
        assert list(freed[:4]) == [1, 1, 1, 1]
    finally:
        loader.close()


class _SignalsAt(shmloader.Dataset):
    """``GrowingDataset``'s shape (from sample 8 on, 4 MiB samples), and ``reached`` is set when sample
    ``signal_at`` is fetched: every reply before that task is written by then."""

    def __init__(self, reached, signal_at: int) -> None:  # noqa: ANN001  # a multiprocessing Event
        self.reached, self.signal_at = reached, signal_at

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> np.ndarray:
        if i == self.signal_at:
            self.reached.set()
        return np.full(1 << 19 if i >= 8 else 4, float(i))


@pytest.mark.timeout(60)
def test_batches_finished_before_a_growth_that_cannot_fit_are_handed_out_first(monkeypatch):
    """A growth refused for lack of shared memory breaks the loader, but the batches the worker had
    finished before the batch that outgrew its slot come first: read in the same wait as its
    ``TooSmall``, they were dropped when the error was raised at once (a flaky loss under load)."""
    from shmloader.errors import ShmSpaceError
    from shmloader.transport import shm_space

    monkeypatch.setattr(shm_space, "shm_free_bytes", lambda d: 12 << 20)  # 1 MiB slots fit, 4 MiB ones not
    reached = mp.get_context("fork").Event()
    loader = shmloader.DataLoader(_SignalsAt(reached, signal_at=10), batch_size=2, num_workers=1, prefetch_factor=6,
                                  multiprocessing_context="fork")
    it = iter(loader)
    real_wait = it._wait

    def first_wait(started: float) -> None:  # the first next() sends tasks 0-5, then waits here
        assert reached.wait(30)  # task 5 started: replies 0-3 (filled) and 4 (too small) are in the pipe
        it._wait = real_wait
        real_wait(started)

    it._wait = first_wait
    try:
        got = []
        with pytest.raises(ShmSpaceError):
            for batch in it:
                got.append(int(batch[0, 0]))
        assert got == [0, 2, 4, 6]
        assert it.closed
    finally:
        loader.close()
