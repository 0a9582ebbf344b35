"""Why a worker could not start, in the words of the limit it hit.

Owns :func:`explain`: an ``OSError`` raised while starting worker ``i`` of ``num_workers`` (a pipe
or a fork refused for lack of descriptors, processes or memory) becomes the same type with the same
errno, whose message names the worker, ``num_workers`` and the limit with its value. Runs in the
main process, when workers start. Promises: any other error is left as it is (None).
"""

from __future__ import annotations

import errno

from shmloader.rlimits import LimitName, soft_limit

__all__ = ["explain"]

_LIMITS: dict[int, LimitName] = {  # errno -> the resource limit it most likely is
    errno.EMFILE: "RLIMIT_NOFILE",
    errno.ENFILE: "RLIMIT_NOFILE",
    errno.EAGAIN: "RLIMIT_NPROC",
}


def explain(exc: OSError, worker_id: int, num_workers: int) -> OSError | None:
    """``exc`` reworded when it is a limit that ``num_workers`` ran into; None otherwise."""
    if exc.errno not in _LIMITS and exc.errno != errno.ENOMEM:
        return None
    text = f"could not start worker {worker_id} of num_workers={num_workers}: {exc.strerror}"
    if exc.errno not in _LIMITS:  # ENOMEM: memory, no limit of this process's to name
        return type(exc)(exc.errno, text + ": lower num_workers (or prefetch_factor), or raise the limit")
    limit = soft_limit(_LIMITS[exc.errno])
    return type(exc)(exc.errno, f"{text} ({limit.describe()}): lower num_workers (or prefetch_factor), "
                                f"or {limit.remedy()}")

