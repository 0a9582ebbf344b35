"""An iterable dataset's epoch is resumed mid-way only where its fast-forward is exact.

An iterable dataset is resumed by making its first ``yielded`` batches again and dropping them
(docs/resume.md). That replays the same batches only with the worker count that saved the state
(each worker iterates its own shard) and with ``in_order=True`` (an ``in_order=False`` epoch
handed batches out in an arrival order no rerun repeats). Loaded otherwise, batches were lost and
others repeated without a word; now ``load_state_dict`` refuses, naming both sides. Between epochs
(no batch handed out yet) nothing is replayed, so any worker count and order loads.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import shmloader
from shmloader.errors import StateError


class Shards(shmloader.IterableDataset):
    """Rows 0..11, each worker taking every num_workers-th one."""

    def __iter__(self) -> Iterator[np.ndarray]:
        info = shmloader.get_worker_info()
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        return iter([np.array([i]) for i in range(first, 12, step)])


def _loader(num_workers: int, in_order: bool = True) -> shmloader.DataLoader:
    return shmloader.DataLoader(Shards(), batch_size=2, num_workers=num_workers, in_order=in_order)


def _mid_epoch_state(num_workers: int, in_order: bool = True) -> dict:
    loader = _loader(num_workers, in_order)
    it = iter(loader)
    next(it), next(it)
    state = it.state_dict()
    loader.close()
    return state


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("saved", "loaded"), [(2, 1), (1, 2), (2, 0), (0, 2)])
def test_a_mid_epoch_state_loads_only_with_the_worker_count_that_saved_it(saved: int, loaded: int) -> None:
    state = _mid_epoch_state(saved)
    loader = _loader(loaded)
    with pytest.raises(StateError, match=rf"num_workers: saved {saved}, this loader {loaded}"):
        loader.load_state_dict(state)
    loader.close()


@pytest.mark.timeout(60)
def test_a_mid_epoch_state_of_an_unordered_epoch_is_refused() -> None:
    state = _mid_epoch_state(2, in_order=False)
    for in_order in (False, True):
        loader = _loader(2, in_order)
        with pytest.raises(StateError, match="in_order=False"):
            loader.load_state_dict(state)
        loader.close()


@pytest.mark.timeout(60)
def test_the_same_worker_count_resumes_exactly() -> None:
    whole = [int(b[0, 0]) for b in _loader(2)]
    state = _mid_epoch_state(2)
    loader = _loader(2)
    loader.load_state_dict(state)
    rest = [int(b[0, 0]) for b in loader]
    assert whole[:2] + rest == whole


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_order", [True, False])
def test_a_state_between_epochs_loads_with_any_worker_count(in_order: bool) -> None:
    saver = _loader(2, in_order)
    assert len(list(saver)) == 6
    state = saver.state_dict()
    loader = _loader(1)
    loader.load_state_dict(state)
    assert sorted(int(b[0, 0]) for b in loader) == [0, 2, 4, 6, 8, 10]
