"""Iterable datasets against torch's DataLoader: where a worker's share ends.

torch's worker stops fetching at the first ``StopIteration`` of its share (``iteration_end``),
whatever its iterator would yield if asked again; shmloader's must too, with and without batching.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import shmloader


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
    loader = shmloader.DataLoader(AfterStop(), num_workers=num_workers, batch_size=batch_size, prefetch_factor=4)
    items = _items(loader)
    one = [[1]] if batch_size is None else [[[1]]]
    two = [[2]] if batch_size is None else [[[2]]]
    assert items == one * num_workers + two * num_workers


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch_size", [None, 1])
def test_a_share_ends_as_torch_ends_it(batch_size: int | None) -> None:
    torch = pytest.importorskip("torch")
    kwargs: dict[str, Any] = dict(num_workers=2, batch_size=batch_size, prefetch_factor=3)

    class TorchAfterStop(_YieldsAfterStop, torch.utils.data.IterableDataset):
        pass

    want = [b.tolist() for b in torch.utils.data.DataLoader(TorchAfterStop(), **kwargs)]
    assert _items(shmloader.DataLoader(AfterStop(), **kwargs)) == want
