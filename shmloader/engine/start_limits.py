"""Why a worker, or the iterator around it, could not start, in the words of the limit it hit.

Owns :func:`explain`: an ``OSError`` raised while starting worker ``i`` of ``num_workers`` (a pipe
or a fork refused for lack of descriptors, processes or memory) becomes the same type with the same
errno, whose message names the worker, ``num_workers`` and the limit with its value; and
:func:`limits_named`, which rewords so what a block raises, and, for the iterator's own
descriptors (``worker_id=None``: its pipes, the directory's listing, its module's file), a bare
``Too many open files``. Runs in the main process, as ``iter(loader)`` starts. Promises: any other
error is left as it is (None), and an error already explained is not explained twice.
"""

from __future__ import annotations

import errno

from shmloader.errors import LoaderError
from shmloader.rewording import Rewording
from shmloader.rlimits import LimitName, soft_limit

__all__ = ["explain", "limits_named"]

_LIMITS: dict[int, LimitName] = {  # errno -> the resource limit it most likely is
    errno.EMFILE: "RLIMIT_NOFILE",
    errno.ENFILE: "RLIMIT_NOFILE",
    errno.EAGAIN: "RLIMIT_NPROC",
}


class limits_named(Rewording):
    """Out of descriptors or processes while starting ``worker_id`` (None: the iterator itself,
    descriptors only): the error names the limit and ``num_workers``; any other goes on as it is.
    ``replacing``: the pid of the dead worker this start replaces (the restart policy), named too.
    A class, not a generator: see ``shmloader.rewording``."""

    __slots__ = ("num_workers", "replacing", "worker_id")

    def __init__(self, num_workers: int, worker_id: int | None = None, replacing: int | None = None) -> None:
        self.num_workers = num_workers
        self.worker_id = worker_id
        self.replacing = replacing

    def reworded(self, exc: BaseException) -> OSError | None:
        if not isinstance(exc, OSError) or exc.__cause__ is not None or isinstance(exc, LoaderError):
            return None  # not ours to word, or explained where it was raised
        return explain(exc, self.worker_id, self.num_workers, self.replacing)


def explain(exc: OSError, worker_id: int | None, num_workers: int, replacing: int | None = None) -> OSError | None:
    """``exc`` reworded when it is a limit that ``num_workers`` ran into; None otherwise.
    ``worker_id=None``: the iterator's own descriptors, before or between its workers' starts.
    ``replacing``: the pid of the dead worker whose successor this was (a restart)."""
    if worker_id is None:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            return None
        text = f"iter(loader) could not open the descriptors of its iterator (num_workers={num_workers}): {exc.strerror}"
    elif exc.errno not in _LIMITS and exc.errno != errno.ENOMEM:
        return None
    else:
        instead = "" if replacing is None else f" in place of its dead predecessor (pid {replacing})"
        text = f"could not start worker {worker_id} of num_workers={num_workers}{instead}: {exc.strerror}"
    if exc.errno not in _LIMITS:  # ENOMEM: memory, no limit of this process's to name
        return type(exc)(exc.errno, text + ": lower num_workers (or prefetch_factor), or raise the limit")
    limit = soft_limit(_LIMITS[exc.errno])
    return type(exc)(exc.errno, f"{text} ({limit.describe()}): lower num_workers (or prefetch_factor), "
                                f"or {limit.remedy()}")

