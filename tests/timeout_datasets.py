"""Datasets whose one slow sample the test controls, for the tests of what follows a timeout.

Module-level and importable (``tests/`` is on ``sys.path`` under pytest), so spawned workers can
unpickle them by reference. The slowness is a *gate* in a directory the test owns: the first time
a worker process reaches the gated sample (or runs ``worker_init_fn``) it writes
``blocked.<pid>`` and blocks until ``release.<pid>`` exists; :func:`release` opens every gate that
is closed now. With ``once=True`` only the first process of all blocks (the sample was slow once,
a network file system's hiccup); without it each worker process blocks the first time (a cache
each worker warms up, a file each worker opens). Nothing here sleeps for synchronisation: the
test decides when a gate opens, and a gate left shut gives up after ``GATE_LIMIT_S``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from shmloader import IterableDataset, get_worker_info

GATE_LIMIT_S = 60.0  # a gate nobody opens lets its worker go after this long (a failing test)


class Gate:
    """Blocks a worker process the first time it passes, until the test opens it (see module doc)."""

    def __init__(self, root: str, once: bool) -> None:
        self.root, self.once = root, once
        self._passed = False  # per process: a forked or spawned worker starts with its own copy

    def pass_once(self) -> None:
        if self._passed or not _in_worker():
            return
        self._passed = True
        if self.once and not _first_of_all(self.root):
            return
        pid = os.getpid()
        open(os.path.join(self.root, f"blocked.{pid}"), "w").close()
        end = time.monotonic() + GATE_LIMIT_S
        while not os.path.exists(os.path.join(self.root, f"release.{pid}")) and time.monotonic() < end:
            time.sleep(0.01)  # the dataset's slowness itself: it lasts until the test opens the gate


def _in_worker() -> bool:
    """In a worker of shmloader's, or of torch's (the parity test runs the gate under torch too)."""
    if get_worker_info() is not None:
        return True
    torch = sys.modules.get("torch")
    return torch is not None and torch.utils.data.get_worker_info() is not None


def _first_of_all(root: str) -> bool:
    try:
        os.close(os.open(os.path.join(root, "first"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def blocked(root: str) -> list[int]:
    """The pids of the worker processes that reached a gate (open or not)."""
    return sorted(int(name.split(".")[1]) for name in os.listdir(root) if name.startswith("blocked."))


def release(root: str) -> list[int]:
    """Open every gate a worker waits at now; returns their pids."""
    pids = blocked(root)
    for pid in pids:
        open(os.path.join(root, f"release.{pid}"), "w").close()
    return pids


class SlowAt:
    """``n`` samples ``(i, pid of the worker)``; sample ``at`` passes ``gate``."""

    def __init__(self, gate: Gate, n: int = 12, at: int = 5) -> None:
        self.gate, self.n, self.at = gate, n, at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        if i == self.at:
            self.gate.pass_once()
        return i, os.getpid()


class SlowStream(IterableDataset):
    """``0..n-1``, worker ``k`` of ``w`` yielding ``k, k+w, ...``, each as ``(i, pid)``; ``at`` passes ``gate``."""

    def __init__(self, gate: Gate, n: int = 12, at: int = 5) -> None:
        self.gate, self.n, self.at = gate, n, at

    def __iter__(self) -> Any:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            if i == self.at:
                self.gate.pass_once()
            yield i, os.getpid()


class InitGate:
    """A ``worker_init_fn`` that passes ``gate``: a worker whose start-up is slow."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def __call__(self, worker_id: int) -> None:
        self.gate.pass_once()


def stream_order(n: int, batch_size: int, workers: int) -> list[list[int]]:
    """The batches of :class:`SlowStream` in torch's order: round robin over the workers' shares."""
    shares = [[list(range(k, n, workers))[j:j + batch_size] for j in range(0, len(range(k, n, workers)), batch_size)]
              for k in range(workers)]
    order = []
    for j in range(max(len(s) for s in shares)):
        order += [s[j] for s in shares if j < len(s)]
    return order


class Announce:
    """A ``worker_init_fn`` that writes ``started.<pid>`` once the worker has started: a test under
    spawn waits for every worker so that its ``timeout=`` bounds batches, not interpreter starts."""

    def __init__(self, root: str) -> None:
        self.root = root

    def __call__(self, worker_id: int) -> None:
        open(os.path.join(self.root, f"started.{os.getpid()}"), "w").close()


def started(root: str) -> int:
    """How many workers :class:`Announce` has seen start."""
    return sum(name.startswith("started.") for name in os.listdir(root))


def warm_descriptors() -> int:
    """This process's open descriptors once a first loader has started and stopped its workers
    (multiprocessing opens some for the process's life at its first use: not a loader's leak)."""
    from shmloader import DataLoader

    loader: DataLoader[Any]
    with DataLoader([0, 1], num_workers=1, multiprocessing_context="fork") as loader:
        list(loader)
    return len(os.listdir("/proc/self/fd"))
