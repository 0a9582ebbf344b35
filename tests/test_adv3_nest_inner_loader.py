"""A dataset whose ``__getitem__``, inside a worker, builds and iterates a DataLoader of its own.

With ``num_workers=0`` the inner loader works in the worker. With workers it cannot: our workers
are daemonic, as torch's are, and multiprocessing refuses a daemonic process children. torch lets
``Process.start`` fail with a bare ``AssertionError: daemonic processes are not allowed to have
children``, which names neither the loader nor the option. Ours says which option, which process,
and what to do, before it starts anything (still an ``AssertionError``, as torch's), and the outer
loader goes on: the error is the batch's own, raised in its place.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import numpy as np
import pytest
from adv3_exit_helpers import InnerLoaderDataset
from process_helpers import workers_left

import shmloader
from shmloader.errors import ConfigError


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_inner_loader_without_workers_works_inside_a_worker(method: str) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(InnerLoaderDataset(0), batch_size=4, num_workers=2, multiprocessing_context=method)
    got = np.concatenate([np.asarray(b).ravel() for b in loader])
    assert got.tolist() == list(range(64))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_inner_loader_with_workers_inside_a_worker_is_a_clear_error(method: str) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(InnerLoaderDataset(1), batch_size=4, num_workers=1, multiprocessing_context=method)
    it = iter(loader)
    errors = []
    for _ in range(len(loader)):  # each batch's error in its place; the loader goes on
        with pytest.raises(AssertionError) as caught:
            next(it)
        errors.append(caught.value)
    with pytest.raises(StopIteration):
        next(it)
    message = str(errors[0])
    for words in ("num_workers=1", "daemonic", "shmloader-worker-0", "num_workers=0", "sample indices [0..3]"):
        assert words in message, message
    assert isinstance(errors[0], ConfigError)
    loader.close()
    assert workers_left(zombies=True) == []


def test_the_check_passes_in_a_process_that_may_have_children() -> None:
    assert not multiprocessing.current_process().daemon
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(np.arange(8)), batch_size=4, num_workers=1)
    assert [x.tolist() for (x,) in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
