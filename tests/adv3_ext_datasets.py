"""Datasets for the faults that come from outside the loader (tests/test_adv3_ext_*.py): the process
tree, signals and the operating system.

Importable by name, so they reach spawned workers. Each fault fires only inside a worker.
"""

from __future__ import annotations

import os
import threading

import numpy as np
from fault_datasets import in_worker

N = 16


class Pids:
    """Sample ``i`` is ``[i, pid of the process that fetched it]``: a test reads which worker made a batch."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, os.getpid()])


class Growing:
    """Sample ``i`` holds ``16 + max(0, i // 4 - flat) * step`` float64 values: with batches of 4,
    after the first ``flat`` + 1 each batch outgrows the last, so the ring grows mid-epoch."""

    def __init__(self, n: int, step: int, flat: int = 0) -> None:
        self.n, self.step, self.flat = n, step, flat

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(16 + max(0, i // 4 - self.flat) * self.step, float(i))


class HangsIgnoringSigterm(Pids):
    """In its worker: ignore SIGTERM and SIGINT (handlers of the dataset's own, as some libraries
    install), note ``hung-<pid>`` in ``directory``, then block for ever: only SIGKILL ends it."""

    def __init__(self, directory: str, n: int = N) -> None:
        super().__init__(n)
        self.directory = directory

    def __getitem__(self, i: int) -> np.ndarray:
        if in_worker():
            import signal

            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, lambda *_: None)
            open(os.path.join(self.directory, f"hung-{os.getpid()}"), "a").close()
            threading.Event().wait()  # the fault: a hang that only SIGKILL ends
        return super().__getitem__(i)


def noted(directory: str, kind: str) -> list[int]:
    """The pids noted as ``kind-<pid>`` files in ``directory``."""
    return [int(name.split("-", 1)[1]) for name in os.listdir(directory) if name.startswith(f"{kind}-")]


class TakesDescriptors(Pids):
    """At sample ``at``, in its worker: close every descriptor from 3 to 63 (a daemonising library's
    ``os.closerange``), then, with ``directory``, open files there that take those numbers again."""

    def __init__(self, at: int, directory: str | None = None) -> None:
        super().__init__()
        self.at, self.directory = at, directory

    def __getitem__(self, i: int) -> np.ndarray:
        if i == self.at and in_worker():
            os.closerange(3, 64)
            if self.directory is not None:
                self.files = [open(os.path.join(self.directory, f"f{k}"), "wb") for k in range(12)]
        return super().__getitem__(i)
