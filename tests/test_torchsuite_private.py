"""torch's iterator's private names that code written for torch reaches for: ``_workers`` (the
workers' process objects: torch's own tests join them after dropping the iterator) and
``_shutdown_workers()`` (teardown helpers call it). torch's test_dataloader.py
``test_partial_workers``, ``test_iterable_style_dataset`` and ``test_shuffler_iterdatapipe``
failed on our iterator for want of them alone."""

from __future__ import annotations

import gc
import multiprocessing
from typing import Any

import numpy as np
import pytest

import shmloader

JOIN_S = 10.0


def _iterator(**kwargs: Any) -> Any:
    return iter(shmloader.DataLoader(shmloader.ArrayDataset(np.arange(40)), batch_size=2, num_workers=2,
                                     multiprocessing_context="fork", **kwargs))


@pytest.mark.timeout(60)
def test_workers_lists_the_processes_which_end_when_the_iterator_is_dropped() -> None:
    it = _iterator()
    workers = it._workers
    assert len(workers) == 2 and all(isinstance(w, multiprocessing.process.BaseProcess) for w in workers)
    assert all(w.is_alive() for w in workers)
    for i, _ in enumerate(it):
        if i == 3:
            break
    del it
    gc.collect()
    for w in workers:  # as torch's test_partial_workers does
        w.join(JOIN_S)
        assert not w.is_alive()


@pytest.mark.timeout(60)
def test_shutdown_workers_is_close() -> None:
    it = _iterator(persistent_workers=True)
    next(it)
    workers = it._workers
    it._shutdown_workers()
    assert it.closed and not any(w.is_alive() for w in workers)
    assert it._workers == []  # shut: none left to list
