"""Datasets, collate functions and init functions that fail on purpose, for the fault tests.

Module-level and importable (``tests/`` is on ``sys.path`` under pytest), so spawned workers can
unpickle them by reference. A *fault* is one of:

- ``raise``: raise :class:`Boom` (a ``ValueError`` subclass, so its type is checked end to end);
- ``kill`` / ``segv``: the worker sends itself SIGKILL / dereferences NULL (a real SIGSEGV);
- ``exit``: ``os._exit(3)``;
- ``hang``: block forever (the fault itself, not a synchronisation), until the loader kills it.

Faults fire only inside a worker process (never in the main process, which pickles these objects).
``once_dir`` makes a fault fire once per (where, index): the first worker to reach it creates a
marker file atomically (``O_CREAT | O_EXCL``) and faults; every later attempt succeeds.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

from shmloader import IterableDataset, get_worker_info

FAULTS = ("raise", "kill", "segv", "exit", "hang")


class Boom(ValueError):
    """The exception the ``raise`` fault raises."""


def in_worker() -> bool:
    return get_worker_info() is not None


def fault(how: str, where: str) -> None:
    """Fail the way ``how`` says; ``where`` only words the exception."""
    if how == "raise":
        raise Boom(f"boom in {where}")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "segv":
        faulthandler.disable()  # a real crash, without a traceback dump cluttering the test output
        ctypes.string_at(0)
    elif how == "exit":
        os._exit(3)
    elif how == "sysexit":
        sys.exit(0)
    elif how == "hang":
        threading.Event().wait()
    raise AssertionError(f"fault {how!r} did not end the worker")


def first_time(once_dir: str | None, tag: str) -> bool:
    """True the first time any process asks about ``tag`` (always True without ``once_dir``)."""
    if once_dir is None:
        return True
    try:
        fd = os.open(os.path.join(once_dir, tag), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def sample(i: int) -> np.ndarray:
    """Sample ``i``: four int64 values that identify it."""
    return np.arange(4, dtype=np.int64) + 10 * i


class FaultyDataset:
    """``n`` samples; faults with ``how`` at ``where``: ``getitem`` (at sample ``at``) or ``unpickle``
    (when a spawned worker unpickles the dataset)."""

    def __init__(self, n: int = 8, where: str = "", how: str = "raise", at: int = 0,
                 once_dir: str | None = None) -> None:
        self.n, self.where, self.how, self.at, self.once_dir = n, where, how, at, once_dir

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if self.where == "getitem" and i == self.at and in_worker() and first_time(self.once_dir, f"get{i}"):
            fault(self.how, "__getitem__")
        return sample(i)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.where == "unpickle" and first_time(self.once_dir, "unpickle"):
            fault(self.how, "dataset unpickling")


class RandomDataset:
    """Samples drawn from numpy's global RNG (so per-task seeding decides them); ``kill_at`` SIGKILLs
    the worker the first time sample ``kill_at`` is fetched (marker files in ``once_dir``)."""

    def __init__(self, n: int, once_dir: str | None = None, kill_at: tuple[int, ...] = ()) -> None:
        self.n, self.once_dir, self.kill_at = n, once_dir, kill_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if i in self.kill_at and in_worker() and first_time(self.once_dir, f"rnd{i}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return np.random.random(3)


class FaultyInit:
    """A ``worker_init_fn`` that faults with ``how`` (once, given ``once_dir``)."""

    def __init__(self, how: str, once_dir: str | None = None) -> None:
        self.how, self.once_dir = how, once_dir

    def __call__(self, worker_id: int) -> None:
        if first_time(self.once_dir, f"init{worker_id}"):
            fault(self.how, "worker_init_fn")


class Abort(BaseException):
    """An exception that is not an ``Exception`` (as some libraries define for cancellation)."""


class ExitingInit:
    """A ``worker_init_fn`` that raises ``what`` (``sys.exit`` with a message, or :class:`Abort`)."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __call__(self, worker_id: int) -> None:
        if self.what == "exit":
            sys.exit(f"no device for worker {worker_id}")
        raise Abort(f"worker {worker_id} cancelled")


class HoldsALock:
    """A dataset, ``collate_fn`` or ``worker_init_fn`` that cannot be pickled (it holds a lock, as one
    holding an open file or a connection would): spawn and forkserver workers cannot receive it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> np.ndarray:
        return sample(i)

    def __call__(self, arg: Any) -> Any:
        return arg


class FaultyCollate:
    """A ``collate_fn`` that faults with ``how`` on the batch holding sample ``at``."""

    def __init__(self, how: str, at: int = 0) -> None:
        self.how, self.at = how, at

    def __call__(self, samples: list[np.ndarray]) -> np.ndarray:
        batch = np.stack(samples)
        if in_worker() and int(batch[0, 0]) // 10 <= self.at <= int(batch[-1, 0]) // 10:
            fault(self.how, "collate_fn")
        return batch


class _KillOnPickle:
    """Pickling it in the worker faults with ``how``."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __reduce__(self) -> Any:
        if in_worker():
            fault(self.how, "pickling the batch")
        return (_KillOnPickle, (self.how,))


class UnpicklableCollate:
    """A ``collate_fn`` whose batch cannot be pickled back to the main process: ``raise`` holds a
    lock (pickle's own TypeError); the others fault while being pickled."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __call__(self, samples: list[np.ndarray]) -> dict[str, Any]:
        extra = threading.Lock() if self.how == "raise" else _KillOnPickle(self.how)
        return {"x": np.stack(samples), "extra": extra}


def _explode(index: int, how: str) -> int:
    if in_worker():
        fault(how, "unpickling the task")
    return index


class BadIndex(int):
    """A sample index whose unpickling (in the worker that receives the task) faults."""

    how = "raise"

    def __new__(cls, value: int, how: str = "raise") -> BadIndex:
        obj = super().__new__(cls, value)
        obj.how = how
        return obj

    def __reduce__(self) -> Any:
        return (_explode, (int(self), self.how))


class BadIndexSampler:
    """A batch sampler of ``n`` samples in batches of 2 whose sample ``at`` is a :class:`BadIndex`."""

    def __init__(self, n: int, at: int, how: str) -> None:
        self.n, self.at, self.how = n, at, how

    def __iter__(self):  # type: ignore[no-untyped-def]
        for start in range(0, self.n, 2):
            yield [BadIndex(i, self.how) if i == self.at else i for i in range(start, min(start + 2, self.n))]

    def __len__(self) -> int:
        return (self.n + 1) // 2


class StampAndDie(FaultyDataset):
    """16 samples; sample 9 writes the wall-clock time to ``stamp``, then SIGKILLs its worker."""

    def __init__(self, stamp: str) -> None:
        super().__init__(16)
        self.stamp = stamp

    def __getitem__(self, i: int) -> np.ndarray:
        if i == 9 and in_worker():
            with open(self.stamp, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return sample(i)


class PlannedFaults:
    """``n`` samples (see :func:`sample`); ``plan`` maps a sample index to the fault it triggers
    the first time any worker fetches it (marker files in ``once_dir``); a retry succeeds."""

    def __init__(self, n: int, once_dir: str, plan: dict[int, str]) -> None:
        self.n, self.once_dir, self.plan = n, once_dir, plan

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        how = self.plan.get(i)
        if how is not None and in_worker() and first_time(self.once_dir, f"plan{i}"):
            fault(how, "__getitem__")
        return sample(i)


class FaultyStream(IterableDataset):
    """An iterable dataset of ``n`` samples, sharded by worker; the worker that reaches sample
    ``at`` faults with ``how`` (see ``fault``)."""

    def __init__(self, n: int, at: int, how: str = "raise") -> None:
        self.n, self.at, self.how = n, at, how

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        for i in range(first, self.n, step):
            if i == self.at and info is not None:
                fault(self.how, f"sample {i}")
            yield sample(i)


class KillingStream(FaultyStream):
    """A ``FaultyStream`` whose worker that reaches sample ``at`` SIGKILLs itself."""

    def __init__(self, n: int, at: int) -> None:
        super().__init__(n, at, "kill")


class UnevenStream(IterableDataset):
    """An iterable dataset sharded by worker whose worker 0 runs out after ``short`` samples (0, 2,
    ...); the other workers' shares go on to ``n``."""

    def __init__(self, n: int, short: int) -> None:
        self.n, self.short = n, short

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        end = min(self.n, first + step * self.short) if first == 0 and info is not None else self.n
        for i in range(first, end, step):
            yield sample(i)


class HangsAt(FaultyDataset):
    """Sample ``at`` hangs in the worker, so the main process waits for that batch for ever (until
    interrupted). With ``note_dir``, the worker first creates the file ``hung`` there (a test waits
    for it: the worker is then inside the hang)."""

    def __init__(self, n: int, at: int, note_dir: str | None = None) -> None:
        super().__init__(n)
        self.at, self.note_dir = at, note_dir

    def __getitem__(self, i: int) -> np.ndarray:
        if i == self.at and in_worker():
            if self.note_dir is not None:
                open(os.path.join(self.note_dir, "hung"), "w").close()
            threading.Event().wait()
        return sample(i)


class GrowingDataset(FaultyDataset):
    """From sample ``at`` on, each sample holds ``floats`` float64 values (the batches outgrow their slot)."""

    def __init__(self, n: int, at: int, floats: int) -> None:
        super().__init__(n)
        self.at, self.floats = at, floats

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.floats if i >= self.at else 4, float(i))
