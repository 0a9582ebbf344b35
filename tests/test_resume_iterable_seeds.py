"""Per-task seeds of an iterable dataset's batches do not depend on when a worker's share ended.

With ``task_seeding=True`` each batch is made under a seed derived from ``(base_seed, epoch,
task)``. An iterable dataset's workers each iterate their own share; a worker whose share has
ended answers the tasks it is dealt with no batch, and the main process learns so only when it
reads that answer, so how many task numbers the ended worker used up (and so which number the
others' later batches got) followed timing and ``prefetch_factor``. The same epoch then drew
other augmentation run after run, and a resume's fast-forward (which makes the first batches
again) gave the rest of the epoch other draws than the uninterrupted run. Now the k-th batch of
worker w is seeded as task ``k * num_workers + w``, its task number whenever no share has ended.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest

import shmloader

ROWS = 10


class OneSidedShards(shmloader.IterableDataset):
    """Worker 0 yields rows [i, a draw from numpy's global RNG]; every other worker's share is empty."""

    def __iter__(self) -> Iterator[np.ndarray]:
        info = shmloader.get_worker_info()
        if info is not None and info.id != 0:
            return iter(())
        return (np.array([i, np.random.randint(1 << 30)], dtype=np.int64) for i in range(ROWS))


def _loader(prefetch_factor: int) -> shmloader.DataLoader:
    return shmloader.DataLoader(OneSidedShards(), batch_size=2, num_workers=2, prefetch_factor=prefetch_factor,
                                task_seeding=True, generator=7, multiprocessing_context="fork")


def _rows(batches: Iterator[np.ndarray]) -> list[list[list[int]]]:
    return [np.asarray(batch).tolist() for batch in batches]


def _epoch(prefetch_factor: int) -> list[list[list[int]]]:
    loader = _loader(prefetch_factor)
    try:
        return _rows(iter(loader))
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_the_draws_do_not_depend_on_how_many_tasks_the_ended_worker_was_dealt() -> None:
    # prefetch_factor=4 deals the empty worker 4 tasks before its first answer is read, 1 deals it one
    few, many = _epoch(1), _epoch(4)
    assert [[row[0] for row in b] for b in few] == [[i, i + 1] for i in range(0, ROWS, 2)]
    assert many == few


@pytest.mark.timeout(60)
@pytest.mark.parametrize("taken", [1, 3])
def test_a_resumed_epoch_draws_what_the_uninterrupted_one_drew(taken: int) -> None:
    uninterrupted = _epoch(4)
    saving = _loader(4)
    it = iter(saving)
    before = [np.asarray(next(it)).tolist() for _ in range(taken)]
    state = json.loads(json.dumps(it.state_dict()))
    saving.close()
    resumed = _loader(1)  # prefetch_factor may differ on resume (docs/resume.md, "What is refused")
    try:
        resumed.load_state_dict(state)
        after = _rows(iter(resumed))
    finally:
        resumed.close()
    assert before + after == uninterrupted
