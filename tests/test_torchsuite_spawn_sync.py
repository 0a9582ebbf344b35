"""A dataset holding multiprocessing objects (Event, Lock, Value, Queue) works under spawn and forkserver.

Such objects pickle only while a process is being started (``Process.start``), which is when torch's
workers receive their dataset. shmloader pickled the worker spec once, beforehand, so each refused:
"RuntimeError: the dataset (...) cannot be pickled, as the 'spawn' start method needs to send it to
each worker: ... Condition objects should only be shared between processes through inheritance".
A process started by spawn has spawn as its default start method, so a loader built there with no
``multiprocessing_context`` met it too. Found by torch's test_dataloader.py (test_proper_exit: its
dataset holds an ``mp.Event``, in a spawned loader process) run against the torch flavour.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest

import shmloader

pytestmark = pytest.mark.timeout(120)


class CountsInShared(shmloader.Dataset):
    """Each fetch adds one to a shared Value, under a Lock, once an Event is set."""

    def __init__(self, ctx: Any, n: int) -> None:
        self.n = n
        self.fetched = ctx.Value("i", 0)
        self.lock = ctx.Lock()
        self.go = ctx.Event()
        self.go.set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        assert self.go.wait(30)
        with self.lock:
            self.fetched.value += 1
        return i


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_dataset_with_multiprocessing_objects(method: str) -> None:
    ctx = multiprocessing.get_context(method)
    data = CountsInShared(ctx, 6)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(data, batch_size=2, num_workers=2,
                                                             multiprocessing_context=method)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    assert data.fetched.value == 6  # the workers' fetches were counted in this process's Value
    loader.close()
