"""An iterable dataset's epoch whose shards are uneven keeps a bounded record of its tasks.

A worker whose share of an iterable dataset has ended answers its last tasks ``Exhausted``; no
batch is ever handed out for them. The epoch's record of delivered tasks (``state.TaskSet``:
``[0, low)`` plus the few above ``low``) did not count them, so ``low`` stopped at the first of
them and every later batch of the other workers joined ``above``: one entry per batch for the
rest of the epoch, copied at each ``to_device`` batch and sorted at each ``state_dict()``. A long
epoch of an uneven dataset (a stream beside a short shard) grew without bound.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import shmloader

_SHORT = 2  # rows of worker 0's shard: it runs out almost at once
_LONG = 120  # rows of worker 1's shard
_TAKEN = 100  # batches of batch_size 1 taken, all but the first few from worker 1


class Uneven(shmloader.IterableDataset):
    """Worker 0 yields ``_SHORT`` rows, worker 1 ``_LONG``."""

    def __iter__(self) -> Iterator[np.ndarray]:
        info = shmloader.get_worker_info()
        rows = _SHORT if info is None or info.id == 0 else _LONG
        return iter([np.array([i]) for i in range(rows)])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_order", [True, False])
def test_a_worker_that_ran_out_leaves_no_growing_record(in_order: bool) -> None:
    loader: shmloader.DataLoader = shmloader.DataLoader(Uneven(), batch_size=1, num_workers=2, in_order=in_order)
    try:
        it = iter(loader)
        for _ in range(_TAKEN):
            next(it)
        record = loader._book.record
        assert record is not None
        assert len(record.delivered.above) <= 4, "tasks above the first undelivered one pile up"
        assert it.state_dict()["delivered"] == [[0, record.delivered.low]]
        assert it.state_dict()["yielded"] == _TAKEN
        assert sum(1 for _ in it) == _SHORT + _LONG - _TAKEN  # nothing lost, nothing repeated
    finally:
        loader.close()
