"""Datasets for the adversarial exactly-once tests (tests/test_adv2_*.py).

Module-level and importable, so spawned workers unpickle them by reference. Each sample ``i`` is
four int64 values that identify it (``fault_datasets.sample``), so a lost, repeated or corrupted
batch shows in its values. A fault fires only inside a worker, only once the test has *armed* it
(a file ``armed`` in ``flag_dir``, created by the test between epochs), and only once: the first
worker to reach it creates a marker with ``O_CREAT | O_EXCL`` and faults.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np

from fault_datasets import first_time, in_worker, sample
from shmloader import IterableDataset, get_worker_info


def arm(flag_dir: str) -> None:
    """Arm the faults of the datasets below that read ``flag_dir``."""
    with open(os.path.join(flag_dir, "armed"), "w"):
        pass


def armed(flag_dir: str) -> bool:
    return os.path.exists(os.path.join(flag_dir, "armed"))


class ArmedFaults:
    """``n`` samples; ``plan`` maps a sample index to ``kill`` (SIGKILL) or ``hang`` (block until
    killed): fired once, after :func:`arm`. ``delay_s`` slows every fetch (batches stay in flight)."""

    def __init__(self, n: int, flag_dir: str, plan: dict[int, str], delay_s: float = 0.0) -> None:
        self.n, self.flag_dir, self.plan, self.delay_s = n, flag_dir, plan, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        how = self.plan.get(i)
        if how is not None and in_worker() and armed(self.flag_dir) and first_time(self.flag_dir, f"fired{i}"):
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait()
        if self.delay_s and in_worker():
            time.sleep(self.delay_s)
        return sample(i)


class InitFailsInOne:
    """A ``worker_init_fn`` that SIGKILLs (``kill``) or raises (``raise``) in worker ``worker`` only,
    once (a marker in ``flag_dir``), when armed."""

    def __init__(self, flag_dir: str, worker: int, how: str) -> None:
        self.flag_dir, self.worker, self.how = flag_dir, worker, how

    def __call__(self, worker_id: int) -> None:
        if worker_id != self.worker or not armed(self.flag_dir) or not first_time(self.flag_dir, "init"):
            return
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"init of worker {worker_id} failed")


class ArmedStream(IterableDataset):
    """``n`` samples sharded by worker; when armed, the worker reaching sample ``at`` SIGKILLs
    itself (once)."""

    def __init__(self, n: int, flag_dir: str, at: int) -> None:
        self.n, self.flag_dir, self.at = n, flag_dir, at

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        for i in range(first, self.n, step):
            if i == self.at and info is not None and armed(self.flag_dir) and first_time(self.flag_dir, "stream"):
                os.kill(os.getpid(), signal.SIGKILL)
            yield sample(i)


class BigThenEnds(IterableDataset):
    """Worker 0 yields sample 0, then sample 2 as ``big_floats`` float64 values (it outgrows its
    slot), then its share ends; every other worker yields its samples ``worker_id``, +2, ... below
    ``n``, four values each. Without workers: the same samples in order of worker 0's then the rest."""

    def __init__(self, n: int, big_floats: int) -> None:
        self.n, self.big_floats = n, big_floats

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        if info is None or info.id == 0:
            yield np.full(4, 0.0)
            yield np.full(self.big_floats, 2.0)
            return
        for i in range(info.id, self.n, info.num_workers):
            yield np.full(4, float(i))
