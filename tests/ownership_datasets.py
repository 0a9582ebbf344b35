"""Module-level datasets for test_ownership.py (importable, so spawned workers can unpickle them).

``Marked``: sample i is ``np.full(width, i)``, so a batch says which samples it holds; one task
raises once and some tasks are slow once (marker files created with ``O_CREAT | O_EXCL`` in
``once_dir`` remember, across processes and epochs, that it already happened), and some tasks are
held in their worker until the test creates ``once_dir/release`` (a gate). ``Big`` makes
batches of a few MiB; ``Indices`` is sample i = ``[i]``; ``collect`` is a ``worker_init_fn`` that
runs the garbage collector in the worker.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Collection

import numpy as np
from fault_datasets import first_time

import shmloader

GATE_LIMIT_S = 30.0  # a gate never opened fails the task instead of hanging the test


class Marked(shmloader.Dataset):
    """``n`` samples of ``width`` float64s equal to the index. In a worker, the first sample of
    task ``fail`` raises KeyError the first time; the first sample of each task in ``gated`` waits
    until ``once_dir/release`` exists (polled; TimeoutError after GATE_LIMIT_S); then the first
    sample of each task in ``slow`` sleeps ``slow_s`` the first time (a slow worker)."""

    def __init__(self, n: int, width: int, once_dir: str, batch: int, fail: int,
                 slow: Collection[int] = (), slow_s: float = 0.3, gated: Collection[int] = ()) -> None:
        self.n, self.width, self.once_dir, self.batch = n, width, once_dir, batch
        self.fail, self.slow, self.slow_s, self.gated = fail, tuple(slow), slow_s, tuple(gated)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if shmloader.get_worker_info() is not None and i % self.batch == 0:
            task = i // self.batch
            if task == self.fail and first_time(self.once_dir, f"fail{task}"):
                raise KeyError(f"task {task} fails once")
            if task in self.gated:
                wait_for(os.path.join(self.once_dir, "release"))
            if task in self.slow and first_time(self.once_dir, f"slow{task}"):
                time.sleep(self.slow_s)
        return np.full(self.width, float(i))


def wait_for(path: str) -> None:
    """Block until ``path`` exists (the test creates it), polling; TimeoutError after GATE_LIMIT_S."""
    deadline = time.monotonic() + GATE_LIMIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was never created")
        time.sleep(0.005)


class Big(shmloader.Dataset):
    """``n`` samples of ``floats`` float64s equal to the index."""

    def __init__(self, n: int, floats: int) -> None:
        self.n, self.floats = n, floats

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.floats, float(i))


class Indices(shmloader.Dataset):
    """Sample i is ``[i]``: a batch is the list of indices the sampler chose."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i], dtype=np.int64)


def collect(_worker_id: int) -> None:
    """A ``worker_init_fn`` that runs a full garbage collection in the worker."""
    gc.collect()
