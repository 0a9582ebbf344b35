"""Datasets and worker_init_fns that fork processes of their own inside a worker (tests/test_procs_*.py).

Importable by name, so they reach spawned and forkserver workers. Every process they fork writes
nothing of ours and ends with ``os._exit`` (or is meant to escape into the worker, where said so);
each one's pid is written to a file in the directory given, so the test can end any that outlive it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import psutil

from shmloader import get_worker_info

N = 16
HELPER_LIFE_S = 60.0  # long enough that a death noticed only at the helper's exit fails the test's bound


def _note_pid(directory: str, kind: str, pid: int) -> None:
    Path(directory, f"{kind}-{pid}").touch()


def noted_pids(directory: str, kind: str) -> list[int]:
    return [int(p.name.split("-", 1)[1]) for p in Path(directory).glob(f"{kind}-*")]


def end_noted(directory: str, kind: str) -> None:
    """SIGKILL every process noted as ``kind`` that still lives, and wait for it to go (bounded)."""
    procs = []
    for pid in noted_pids(directory, kind):
        try:
            proc = psutil.Process(pid)
            proc.kill()
            procs.append(proc)
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(procs, timeout=10)


class StartsHelper:
    """worker_init_fn: fork a helper process that lives on (``HELPER_LIFE_S``), as a library that
    starts a background process with a bare fork does. It inherits every descriptor of the worker."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, worker_id: int) -> None:
        pid = os.fork()
        if pid == 0:
            try:
                time.sleep(HELPER_LIFE_S)
            finally:
                os._exit(0)
        _note_pid(self.directory, "helper", pid)


class DiesAt:
    """Sample ``i`` is four copies of ``i``; fetching sample ``index`` SIGKILLs the worker, the
    first time only when ``once_dir`` is given (a marker file there records it)."""

    def __init__(self, index: int, once_dir: str | None = None) -> None:
        self.index = index
        self.once_dir = once_dir

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        if i == self.index and get_worker_info() is not None and self._first():
            os.kill(os.getpid(), signal.SIGKILL)
        return np.full(4, i)

    def _first(self) -> bool:
        if self.once_dir is None:
            return True
        try:
            os.close(os.open(os.path.join(self.once_dir, "died"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True


class ForkChildEscapes:
    """Sample ``i`` is ``(i, pid of the process that fetched it)``. Fetching sample ``index`` forks
    a child that raises before it reaches its ``os._exit`` (a library's error handling gone wrong),
    so the exception climbs out of ``__getitem__`` into the worker's own code in the child; the
    worker waits for that child and notes its exit status."""

    def __init__(self, index: int, directory: str) -> None:
        self.index = index
        self.directory = directory

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        if i == self.index and get_worker_info() is not None:
            pid = os.fork()
            if pid == 0:
                raise ValueError("raised in a child forked by the dataset, before its os._exit")
            _note_pid(self.directory, "escaped", pid)
            _, status = os.waitpid(pid, 0)
            Path(self.directory, "status").write_text(str(os.waitstatus_to_exitcode(status)))
        return np.array([i, os.getpid()])


class InitForkReturns:
    """worker_init_fn: worker 0 forks a child that returns from here instead of exiting (a fork
    helper missing its ``os._exit``), so the child goes on into the worker's own code."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, worker_id: int) -> None:
        if worker_id != 0:
            return
        pid = os.fork()
        if pid:
            _note_pid(self.directory, "escaped", pid)


class Pids:
    """Sample ``i`` is ``(i, pid of the process that fetched it)``."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, os.getpid()])
