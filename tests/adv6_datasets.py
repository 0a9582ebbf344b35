"""Datasets and ``worker_init_fn``s for tests/test_adv6_*.py: user code that takes a worker's
descriptors before the worker serves its first task, and samples that outgrow the first slot.

Importable by name, so they reach spawned workers. Each fault fires only inside a worker.
"""

from __future__ import annotations

import os

import numpy as np

BIG = 1 << 19  # float64s: a 4 MiB sample, four times the first slot: its task answers TooSmall
NUDGE_FD = -1  # the pool's nudge write end, set by the test before a fork context starts workers


class Outgrows:
    """Sample ``i``: ``BIG`` float64 values ``i`` when ``i`` is in ``big``, else four."""

    def __init__(self, n: int, big: tuple[int, ...]) -> None:
        self.n, self.big = n, big

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(BIG if i in self.big else 4, float(i))


class TakesDescriptorsAtInit:
    """A ``worker_init_fn`` that closes every descriptor from 3 to 63 (a daemonising library's
    ``os.closerange``) and opens files in ``directory`` that take those numbers again."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, worker_id: int) -> None:
        os.closerange(3, 64)
        self.files = [open(os.path.join(self.directory, f"w{worker_id}-{k}"), "wb", buffering=0) for k in range(12)]


class TakesNudgeAtInit:
    """A ``worker_init_fn`` that puts a file of ``directory`` onto ``NUDGE_FD`` (``os.dup2``)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, worker_id: int) -> None:
        with open(os.path.join(self.directory, f"w{worker_id}"), "wb", buffering=0) as file:
            os.dup2(file.fileno(), NUDGE_FD)
