"""Iterable datasets against torch's DataLoader: where a worker's share ends.

torch's worker stops fetching at the first ``StopIteration`` of its share (``iteration_end``),
whatever its iterator would yield if asked again; shmloader's must too, with and without batching.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.errors import LoaderError


class _YieldsAfterStop:
    """Its own iterator: items 1, 2, then ``StopIteration`` — and, asked again (which the iterator
    protocol forbids but nothing prevents), items 4, 5, ... until 10. Each worker has its copy."""

    def __init__(self) -> None:
        self.i = 0

    def __iter__(self) -> _YieldsAfterStop:
        return self

    def __next__(self) -> np.ndarray:
        self.i += 1
        if self.i == 3 or self.i > 10:
            raise StopIteration
        return np.array([self.i])


class AfterStop(_YieldsAfterStop, shmloader.IterableDataset):
    pass


def _items(loader: Any) -> list[Any]:
    return [np.asarray(b).tolist() for b in loader]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("batch_size", [None, 1])
def test_a_share_ends_at_its_first_stop_iteration(num_workers: int, batch_size: int | None) -> None:
    # batch_size=None used to ask the iterator again for each task already sent to the worker
    # (prefetch_factor of them), delivering [4], [5], ... after the worker's share had ended
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(AfterStop(), num_workers=num_workers,
                                                             batch_size=batch_size, prefetch_factor=4)
    items = _items(loader)
    one = [[1]] if batch_size is None else [[[1]]]
    two = [[2]] if batch_size is None else [[[2]]]
    assert items == one * num_workers + two * num_workers


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch_size", [None, 1])
def test_a_share_ends_as_torch_ends_it(batch_size: int | None) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import IterableDataset as TorchIterable

    kwargs: dict[str, Any] = dict(num_workers=2, batch_size=batch_size, prefetch_factor=3)

    class TorchAfterStop(_YieldsAfterStop, TorchIterable):
        pass

    want = [b.tolist() for b in torch.utils.data.DataLoader(TorchAfterStop(), **kwargs)]
    assert _items(shmloader.DataLoader(AfterStop(), **kwargs)) == want


class FailsSecondIter(shmloader.IterableDataset):
    """Worker w yields ``100 * w + i`` for i < 3; worker 1's second ``__iter__`` (the second epoch of
    persistent workers: each worker counts the calls on its own copy) raises ``KeyError``."""

    def __init__(self) -> None:
        self.calls = 0

    def __iter__(self) -> Any:
        self.calls += 1
        info = shmloader.get_worker_info()
        wid = 0 if info is None else info.id
        if wid == 1 and self.calls == 2:
            raise KeyError("no stream this epoch")
        return iter([np.array([100 * wid + i]) for i in range(3)])


def _epoch_with_errors(loader: Any) -> list[Any]:
    """Each batch, or the type of the error raised in its place, until the epoch ends."""
    out: list[Any] = []
    it = iter(loader)
    while True:
        try:
            out.append(np.asarray(next(it)).tolist())
        except StopIteration:
            return out
        except Exception as exc:  # the batch's error: iteration may go on, as in torch
            out.append((type(exc).__name__, str(exc).split("\n")[0]))
            if isinstance(exc, LoaderError):  # the loader's own fault: the epoch is over
                return out


@pytest.mark.timeout(60)
def test_an_iter_that_fails_in_a_later_persistent_epoch_is_the_dataset_error() -> None:
    # it used to kill the worker: WorkerDied "exit code 1", the KeyError on stderr only
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(FailsSecondIter(), num_workers=2, batch_size=2,
                                                             persistent_workers=True)
    try:
        first = _epoch_with_errors(loader)
        second = _epoch_with_errors(loader)
        third = _epoch_with_errors(loader)
    finally:
        loader.close()
    assert first == third == [[[0], [1]], [[100], [101]], [[2]], [[102]]]
    assert second[0] == [[0], [1]]
    assert second[1][0] == "KeyError" and "worker process 1" in second[1][1], second
    assert second[2:] == [[[2]]]  # worker 1's share is over; worker 0's goes on


def _worker_id() -> int:
    """The worker's id from shmloader's get_worker_info(), or from torch's in torch's workers; 0 in
    the main process."""
    info = shmloader.get_worker_info()
    if info is None and "torch" in sys.modules:
        info = sys.modules["torch"].utils.data.get_worker_info()
    return 0 if info is None else info.id


class FailsFirstIter(shmloader.IterableDataset):
    """Worker w yields ``100 * w + i`` for i < 3; worker 1's ``__iter__`` raises ``KeyError``."""

    def __iter__(self) -> Any:
        wid = _worker_id()
        if wid == 1:
            raise KeyError("no stream for this worker")
        return iter([np.array([100 * wid + i]) for i in range(3)])


def _outcomes(loader: Any, count: int) -> list[Any]:
    """The first ``count`` outcomes of an epoch: each batch, or its error's type and first line."""
    out: list[Any] = []
    it = iter(loader)
    try:
        while len(out) < count:
            try:
                out.append(np.asarray(next(it)).tolist())
            except StopIteration:
                break
            except Exception as exc:
                out.append((type(exc).__name__, str(exc).split("\n")[0]))
    finally:
        if hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent_workers", [False, True])
def test_an_iter_that_fails_in_the_first_epoch_ends_that_workers_share_only(persistent_workers: bool) -> None:
    # torch raises worker 1's KeyError in place of its first batch and goes on with worker 0's
    # batches (then, asked again, answers each of worker 1's later tasks with an UnboundLocalError
    # of its own worker loop, for ever); ours raises the KeyError there, goes on with worker 0's
    # batches and ends, as it does when __iter__ fails in a later persistent epoch. It used to stop
    # the whole iterator at the KeyError (LoaderError at the next next(): worker 0's [2] was lost).
    torch = pytest.importorskip("torch")
    from torch.utils.data import IterableDataset as TorchIterable

    class TorchFailsFirstIter(TorchIterable):
        __iter__ = FailsFirstIter.__iter__

    kwargs: dict[str, Any] = dict(num_workers=2, batch_size=2)
    theirs = _outcomes(torch.utils.data.DataLoader(TorchFailsFirstIter(), **kwargs), 3)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(FailsFirstIter(), persistent_workers=persistent_workers,
                                                             **kwargs)
    try:
        epochs = [_outcomes(loader, 10) for _ in range(2)]
    finally:
        loader.close()
    assert theirs[0] == [[0], [1]] and theirs[2] == [[2]], theirs
    for ours in epochs:
        assert [ours[0], ours[2:]] == [theirs[0], [theirs[2]]], ours
        assert ours[1][0] == theirs[1][0] == "KeyError"
        assert ours[1][1].startswith(theirs[1][1].rstrip(".")), (ours[1], theirs[1])
