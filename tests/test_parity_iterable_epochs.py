"""torch parity of an iterable dataset's epochs, side by side with torch's ``DataLoader``: what each
``next()`` gives and which warning it raises, in order.

- torch's warnings, word for word and at the same ``next()``: "Length of IterableDataset ... was
  reported to be N ... but M samples have been fetched" (a ``__len__`` too small, with and without
  workers, batching and ``drop_last``; the length read at ``iter()``, so a ``len(loader)`` after it
  counts from the next epoch) and "This DataLoader will create N worker processes in total" (at
  construction and at each ``iter()`` that starts workers);
- what ``torch.utils.data.get_worker_info()`` says in each worker (``id``, ``num_workers``, ``seed``
  from a seeded generator, ``dataset`` being the worker's own copy) and how torch and numpy are
  seeded there (tests/test_parity_loader.py shards under spawn too);
- an ``__iter__`` that returns the dataset itself, and one whose stream depends on an epoch number
  the main process sets between epochs: with ``persistent_workers=True`` each worker keeps its own
  copy of the dataset, so the workers do not see the main process's change, under torch as here.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402

import shmloader.torch as st  # noqa: E402


def _worker() -> tuple[int, int]:
    info = tdata.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class Sharded(tdata.IterableDataset):
    """``range(7)`` sharded over the workers, reporting ``reported`` as its length."""

    def __init__(self, reported: int) -> None:
        self.reported = reported

    def __len__(self) -> int:
        return self.reported

    def __iter__(self) -> Any:
        start, step = _worker()
        return iter([np.int64(i) for i in range(start, 7, step)])

    def __repr__(self) -> str:  # the warning names the dataset: the same words for both loaders
        return f"Sharded(reported={self.reported})"


class ItsOwnIterator(tdata.IterableDataset):
    """``__iter__`` returns the dataset; its position lives on it (on each worker's copy)."""

    def __init__(self) -> None:
        self.i = 0

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> np.int64:
        if self.i >= 3:
            raise StopIteration
        self.i += 1
        return np.int64(100 * _worker()[0] + self.i)


class EpochStream(tdata.IterableDataset):
    """Each sample says the epoch the dataset's copy knows and how often that copy was iterated."""

    def __init__(self) -> None:
        self.epoch = 0
        self.calls = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        self.calls += 1
        wid = _worker()[0]
        return iter([np.int64(1000 * self.epoch + 100 * wid + 10 * self.calls + i) for i in range(2)])


def _events(make: Callable[[], Any], epochs: int, between: Callable[[Any, int], None] | None = None,
            length: bool = True) -> list[Any]:
    """Each warning (its words, addresses dropped) and each batch (as a list), in the order met."""
    events: list[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Python 3.12+ at a fork while another thread of this process (a loader's, torch's) is alive
        warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)

        def take_warnings() -> None:
            events.extend(("warn", re.sub(r" at 0x[0-9a-f]+", "", str(w.message))) for w in caught)
            caught.clear()

        loader = make()
        take_warnings()
        if length:
            events.append(("len", len(loader)))
        try:
            for epoch in range(epochs):
                if between is not None:
                    between(loader, epoch)
                it = iter(loader)
                take_warnings()
                for batch in it:
                    take_warnings()
                    events.append(np.asarray(batch).tolist())
                events.append("end")
        finally:
            if hasattr(loader, "close"):
                loader.close()
            elif getattr(loader, "_iterator", None) is not None:
                loader._iterator._shutdown_workers()
    return events


def _same(make: Callable[[type], Any], epochs: int = 2, **kwargs: Any) -> list[Any]:
    theirs = _events(lambda: make(tdata.DataLoader), epochs, **kwargs)
    ours = _events(lambda: make(st.DataLoader), epochs, **kwargs)
    assert ours == theirs
    return theirs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reported", [3, 7])
@pytest.mark.parametrize(("batch_size", "drop_last"), [(None, False), (1, False), (3, False), (3, True)])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_wrong_length_warns_as_torch_warns(num_workers: int, batch_size: int | None, drop_last: bool,
                                             reported: int) -> None:
    events = _same(lambda cls: cls(Sharded(reported), num_workers=num_workers, batch_size=batch_size,
                                   drop_last=drop_last))
    warned = any(isinstance(e, tuple) and e[0] == "warn" for e in events)
    batches = sum(1 for e in events if isinstance(e, (list, int))) // 2  # each epoch's
    assert warned == (batches > reported), events  # torch counts batches against the samples reported


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent_workers", [False, True])
def test_a_length_read_between_epochs_counts_from_the_next_iter(persistent_workers: bool) -> None:
    def late_len(loader: Any, epoch: int) -> None:
        if epoch == 1:
            len(loader)

    events = _same(lambda cls: cls(Sharded(2), num_workers=2, batch_size=1, persistent_workers=persistent_workers),
                   epochs=3, between=late_len, length=False)
    assert [e[0] if isinstance(e, tuple) else e for e in events].count("warn") == 2 * 5  # epochs 1 and 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent_workers", [False, True])
def test_too_many_workers_warn_as_torch_warns(monkeypatch: pytest.MonkeyPatch, persistent_workers: bool) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0}, raising=False)
    events = _same(lambda cls: cls(Sharded(7), num_workers=2, batch_size=3, persistent_workers=persistent_workers),
                   epochs=2)
    warned = [e[1] for e in events if isinstance(e, tuple) and e[0] == "warn"]
    assert len(warned) == (2 if persistent_workers else 3), events  # construction, then each start of workers
    assert all(w.startswith("This DataLoader will create 2 worker processes in total") for w in warned)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent_workers", [False, True])
@pytest.mark.parametrize("batch_size", [None, 2])
def test_an_iter_that_returns_the_dataset_itself(batch_size: int | None, persistent_workers: bool) -> None:
    events = _same(lambda cls: cls(ItsOwnIterator(), num_workers=2, batch_size=batch_size,
                                   persistent_workers=persistent_workers), epochs=2, length=False)
    # persistent workers' copies are spent after the first epoch: the second is empty, as in torch
    assert events.count("end") == 2 and (events[-2] == "end") == persistent_workers


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("num_workers", "persistent_workers"), [(0, False), (2, False), (2, True)])
def test_persistent_workers_do_not_see_the_main_processs_set_epoch(num_workers: int,
                                                                     persistent_workers: bool) -> None:

    def set_epoch(loader: Any, epoch: int) -> None:
        loader.dataset.set_epoch(epoch + 1)

    events = _same(lambda cls: cls(EpochStream(), num_workers=num_workers, batch_size=2,
                                   persistent_workers=persistent_workers), epochs=3, between=set_epoch, length=False)
    last = events[-2]
    assert isinstance(last, list)
    # the last epoch's batch: epoch 3 where each epoch sends the dataset again, epoch 1 (as the
    # workers started) and a third __iter__ on each worker's own copy where the workers persist
    assert last[0] // 1000 == (1 if persistent_workers else 3)
    assert last[0] % 100 // 10 == (3 if persistent_workers or not num_workers else 1)


class WhoAmI(tdata.IterableDataset):
    """One sample per worker: what torch's get_worker_info() says there, and the first draws."""

    def __iter__(self) -> Any:
        info = tdata.get_worker_info()
        assert info is not None
        yield {"id": info.id, "num_workers": info.num_workers, "seed": info.seed,
               "dataset_is_self": info.dataset is self, "torch_seed": torch.initial_seed(),
               "numpy": int(np.random.randint(1 << 30)), "torch": int(torch.randint(1 << 30, ()))}


@pytest.mark.timeout(60)
def test_each_worker_sees_torchs_worker_info() -> None:
    def make(cls: type) -> Any:
        return cls(WhoAmI(), batch_size=None, num_workers=2, generator=torch.Generator().manual_seed(5))

    def seen(loader: Any) -> list[dict[str, Any]]:
        try:
            return [{k: v.item() if hasattr(v, "item") else v for k, v in sample.items()} for sample in loader]
        finally:
            if hasattr(loader, "close"):
                loader.close()

    theirs, ours = seen(make(tdata.DataLoader)), seen(make(st.DataLoader))
    assert ours == theirs
    assert [(s["id"], s["num_workers"], s["dataset_is_self"]) for s in ours] == [(0, 2, True), (1, 2, True)]
    assert ours[1]["seed"] == ours[0]["seed"] + 1 == ours[1]["torch_seed"]
