"""Module-level datasets for engine tests (importable, so spawn workers can load them)."""

from __future__ import annotations

import os
import random

import numpy as np

import shmloader


class Squares(shmloader.Dataset):
    """Sample i: a dict with a float32 vector, an int label and a string."""

    def __init__(self, n: int = 40, width: int = 8) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": np.full(self.width, i * i, np.float32), "y": i, "name": f"s{i}"}


class VarLen(shmloader.Dataset):
    """Sample i has i*grow float64 values: later batches need larger slots."""

    def __init__(self, n: int = 24, grow: int = 20_000) -> None:
        self.n, self.grow = n, grow

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.grow * (i // 4 + 1), float(i))


class WorkerSeeds(shmloader.Dataset):
    """Reports the worker's info and its first draws from random and numpy."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple:
        info = shmloader.get_worker_info() or _torch_worker_info()
        return (info.id, info.seed, info.num_workers, random.random(), float(np.random.random()), os.getpid())


class Range(shmloader.IterableDataset):
    """range(start, end) sharded across workers the way torch's docs do it."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = shmloader.get_worker_info()
        if info is None:
            return iter(range(self.start, self.end))
        per = -(-(self.end - self.start) // info.num_workers)
        lo = self.start + info.id * per
        return iter(range(lo, min(lo + per, self.end)))


def _log_fetch(log: str | None, i: int) -> None:
    if log is not None:
        with open(log, "a") as f:  # one short append per fetch: lines from several workers never mix
            f.write(f"{i}\n")


class Big(shmloader.Dataset):
    """Sample i: ``{"x": float32[floats] all i, "y": i}``; with ``log``, each fetch appends i to it."""

    def __init__(self, n: int, floats: int, log: str | None = None) -> None:
        self.n, self.floats, self.log = n, floats, log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        _log_fetch(self.log, i)
        return {"x": np.full(self.floats, i, np.float32), "y": i}


class BigStream(shmloader.IterableDataset):
    """``n`` samples like ``Big``'s, sharded by worker (i % num_workers); each one drawn appends i to ``log``."""

    def __init__(self, n: int, floats: int, log: str) -> None:
        self.n, self.floats, self.log = n, floats, log

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = shmloader.get_worker_info()
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        for i in range(first, self.n, step):
            _log_fetch(self.log, i)
            yield {"x": np.full(self.floats, i, np.float32), "y": i}


class FailsAt(shmloader.Dataset):
    def __init__(self, bad: int, n: int = 12) -> None:
        self.bad, self.n = bad, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            raise KeyError(f"no sample {i}")
        return i


def pair_collate(batch: list) -> tuple:
    """A user collate_fn returning ordinary (heap) arrays."""
    return np.stack([b["x"] for b in batch]) + 1, [b["name"] for b in batch]


def record_init(worker_id: int) -> None:
    np.random.seed(1000 + worker_id)


def _torch_worker_info():  # the same dataset runs under torch's DataLoader in parity tests
    from torch.utils.data import get_worker_info

    return get_worker_info()
